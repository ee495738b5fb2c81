"""Stage `tasks` (asset training_tasks): the task world and the training-task set with its held-out split and replay."""
