"""Channel plugins (DESIGN §9): the contract every plugin implements, the loader for user plugins,
and the first-party channels. A plugin imports `plugins.contract` and its platform library, nothing
else of the server or the gateway."""
