"""The access decision (gateway/access.py) as a table: `dm_policy` says who may use the bot, in DMs
and groups alike; `group_policy` says which group messages count. A stranger must not reach the agent
by adding the bot to a group of their own (docs/channels.md, "Access")."""

from __future__ import annotations

import pytest

from gateway.access import AccessPolicy

OWNER, FRIEND, STRANGER = "123456789", "555", "666"


def verdict(policy: AccessPolicy, sender: str, *, chat_type: str = "group", mention: bool = True) -> str:
    approved = sender == FRIEND  # FRIEND paired and was approved
    return policy.decide(
        chat_type=chat_type, sender=sender, sender_is_bot=False, mentions_bot=mention, approved=approved
    )[0]


@pytest.mark.parametrize("group", ["mention", "open", "allowlist"])
@pytest.mark.parametrize("dm", ["pairing", "allowlist", "disabled"])
def test_a_stranger_gets_nothing_in_a_group_unless_dms_are_open(dm: str, group: str) -> None:
    """The documented personal bot (dm_policy pairing, admins = the owner) and its kin: a stranger's
    mention in a group is refused, with no pairing code (a code is never posted in a group)."""
    policy = AccessPolicy.from_settings({"dm_policy": dm, "group_policy": group, "admins": [OWNER]})
    assert verdict(policy, STRANGER) == "deny"
    verdict_, reason = policy.decide(
        chat_type="group", sender=STRANGER, sender_is_bot=False, mentions_bot=True, approved=False
    )
    assert verdict_ == "deny" and reason.startswith("group: ")
    if group != "allowlist":
        assert "neither on the allowlist nor paired" in reason and "direct message" in reason
    assert verdict(policy, OWNER) == "allow"  # an admin
    assert verdict(policy, FRIEND) == "allow"  # an approved pairing


def test_mention_policy_needs_a_mention_and_a_known_sender() -> None:
    policy = AccessPolicy.from_settings({"dm_policy": "pairing", "admins": [OWNER], "allow": [FRIEND]})
    assert verdict(policy, OWNER, mention=False) == "deny"
    assert policy.decide(chat_type="group", sender=OWNER, sender_is_bot=False, mentions_bot=False, approved=False) == (
        "deny",
        "group: the bot was not mentioned",
    )
    assert verdict(policy, OWNER) == "allow"
    assert verdict(policy, STRANGER) == "deny"


def test_open_dms_or_a_star_let_everyone_in_a_group_through_as_before() -> None:
    for settings in ({"dm_policy": "open"}, {"dm_policy": "pairing", "allow": ["*"]}):
        mention = AccessPolicy.from_settings(settings)
        assert verdict(mention, STRANGER) == "allow"
        assert verdict(mention, STRANGER, mention=False) == "deny"
        everyone = AccessPolicy.from_settings({**settings, "group_policy": "open"})
        assert verdict(everyone, STRANGER, mention=False) == "allow"
    # group_policy allowlist stays "only listed senders", even with open DMs
    listed_only = AccessPolicy.from_settings({"dm_policy": "open", "group_policy": "allowlist", "allow": [FRIEND]})
    assert verdict(listed_only, STRANGER) == "deny" and verdict(listed_only, FRIEND, mention=False) == "allow"


def test_direct_messages_are_decided_as_before() -> None:
    pairing = AccessPolicy.from_settings({"dm_policy": "pairing", "admins": [OWNER]})
    assert verdict(pairing, STRANGER, chat_type="dm", mention=False) == "pair"
    assert verdict(pairing, OWNER, chat_type="dm", mention=False) == "allow"
    allowlist = AccessPolicy.from_settings({"dm_policy": "allowlist"})
    assert verdict(allowlist, STRANGER, chat_type="dm") == "deny"
    disabled = AccessPolicy.from_settings({"dm_policy": "disabled", "admins": [OWNER]})
    assert verdict(disabled, OWNER, chat_type="dm") == "deny"
    assert verdict(disabled, OWNER) == "allow"  # disabled DMs, but the owner still uses the bot in a group


@pytest.mark.parametrize("chat_type", ["channel", "", "DM", "supergroup"])
def test_a_chat_type_outside_the_contract_is_a_group_never_a_dm(chat_type: str) -> None:
    """The contract has `dm` and `group`; a user plugin's "channel" is not private: a stranger there
    gets no pairing code (it would be posted to everyone), a known sender is decided as in a group."""
    policy = AccessPolicy.from_settings({"dm_policy": "pairing", "admins": [OWNER]})
    assert verdict(policy, STRANGER, chat_type=chat_type) == "deny"
    assert verdict(policy, OWNER, chat_type=chat_type, mention=False) == "deny"  # group_policy mention applies
    assert verdict(policy, OWNER, chat_type=chat_type) == "allow"
    assert verdict(policy, STRANGER, chat_type="dm") == "pair"


def test_ids_given_as_a_list_are_stripped_like_the_comma_string() -> None:
    listed = AccessPolicy.from_settings({"allow": [" 555 ", "\t777"], "admins": [" 123456789", "  "]})
    parsed = AccessPolicy.from_settings({"allow": " 555 , 777", "admins": " 123456789 ,"})
    assert listed.allow == parsed.allow == frozenset({"555", "777"})
    assert listed.admins == parsed.admins == frozenset({OWNER})
    assert verdict(listed, "777", chat_type="dm") == "allow" and listed.is_admin(OWNER)
