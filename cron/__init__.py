"""Cron, the clock front end: crons.json store and lease (store, lease), schedules (schedule), the
scheduler (scheduler), firing glue (runner, envelope), the run log (runlog), the one adapter to the
kernel (adapter) and the service inside `serve` (service). Cron never imports another front end."""
