"""The environments that ship with Perpetua; importing this module registers them."""

from ops.envs import calculator  # noqa: F401
from ops.envs import code_repair  # noqa: F401
from ops.envs import reasoning_gym  # noqa: F401
