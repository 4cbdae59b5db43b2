"""Failures seen through Ray, turned into the raypipe errors a user can act on."""
from __future__ import annotations

from collections.abc import Callable

import ray

from raypipe.errors import RaypipeError, StageError, StepAborted


def first_failure(refs: list) -> BaseException | None:
    """A failed step's cause among finished ``refs``: the first stage error that is
    not a consequence (:class:`StepAborted`) of another; else the first failure."""
    failures = []
    for ref in refs:
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            failures.append(error.cause if isinstance(error.cause, StageError) else error)
        except ray.exceptions.RayError as error:
            failures.append(error)
    return first_cause(failures)


def first_cause(failures: list[BaseException]) -> BaseException | None:
    """Among a failed step's ``failures``, the first stage error that is not a
    consequence (:class:`StepAborted`) of another; else the first failure."""
    causes = [f for f in failures if isinstance(f, StageError) and not isinstance(f, StepAborted)]
    return (causes or failures or [None])[0]


def as_raypipe_error(error: BaseException, worker_of: Callable[[Exception], int | None]) -> RaypipeError:
    """``error`` as a raypipe error: a stage's own error keeps its type and fields;
    a dead worker is named by ``worker_of``."""
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, RaypipeError):
        error = error.cause
    if isinstance(error, StageError):  # a fresh one of the same type and fields (each subclass pickles its own)
        rebuild, arguments = error.__reduce__()[:2]
        return rebuild(*arguments)
    if isinstance(error, RaypipeError):
        return error
    if isinstance(error, ray.exceptions.RayActorError):
        worker = worker_of(error)
        return RaypipeError(f"stage worker {'?' if worker is None else worker} died: {error}")
    return RaypipeError(f"a stage task failed: {error}")


def original_cause(error: BaseException) -> BaseException | None:
    """The user's own exception behind ``error``, for ``raise ... from``."""
    if isinstance(error, ray.exceptions.RayTaskError):
        error = error.cause
    return getattr(error, "original", None)
