"""Cron: crons.json store and lease (store, lease), schedules (schedule), the scheduler
(scheduler), firing glue for the kernel (runner, envelope) and the run log (runlog)."""
