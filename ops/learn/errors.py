"""The learner's one error type, shared by the step, its optimizers and the process entry."""


class LearnerError(RuntimeError):
    """The learner step cannot proceed (the message says why)."""
