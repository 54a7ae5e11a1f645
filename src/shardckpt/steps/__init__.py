"""A committed step on any store (:mod:`.view`) and the committed steps of a location (:mod:`.locations`).

Both are re-exported here: ``from shardckpt import steps`` reads as the one place a step is looked at.
"""

from shardckpt.steps.locations import (  # noqa: F401 - the package's API
    LocalSteps,
    RemoteSteps,
    Steps,
    choose_step,
    commit_fetched,
    fetch_step,
    not_committed,
    open_steps,
    remote_step,
)
from shardckpt.steps.view import CheckReport, OnBytes, StepView, is_url  # noqa: F401 - the package's API
