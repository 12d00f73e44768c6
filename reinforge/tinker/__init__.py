"""reinforge as a Tinker backend: `reinforge serve-tinker` serves the `tinker` SDK's API (sessions, training clients
on reinforge's training backend, sampling clients on its generation engines, checkpoints) on the user's own
machines. app.py (HTTP) -> service.py (state, admission) -> futures.py (the device's queue) -> device.py (the
work), with wire.py (the SDK's wire formats) and config.py."""
