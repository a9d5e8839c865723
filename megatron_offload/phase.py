"""The coordinator's iteration phase, shared by the coordinator and its concern modules."""

import enum


class Phase(enum.Enum):
    """Where the coordinator is in the iteration (for assertions, logs and tests)."""

    NO_STATE = "no_state"  # before the first optimizer step created the state
    FREEING = "freeing"  # after a step: state copying out, freed during the next forward
    OFFLOADED = "offloaded"  # everything that is going to be freed is freed
    RELOADING = "reloading"  # in the last backward(s): state coming back
    STEPPING = "stepping"  # inside the inner optimizer step: state resident
