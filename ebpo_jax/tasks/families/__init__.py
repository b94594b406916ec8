"""The task families the trainer builds by name (tasks.protocol.build_task)."""
