"""raypipe's exception types."""
from __future__ import annotations


class RaypipeError(RuntimeError):
    """Base class of raypipe's runtime errors."""


class ConfigError(ValueError):
    """A configuration value is invalid; raised before any actor starts."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {field}={value!r}: {allowed}")


class StageError(RaypipeError):
    """An op failed inside a stage actor.

    ``stage``, ``op`` and ``micro_batch`` say where (and ``replica``, when the
    run has several); ``__cause__`` is the original exception and
    ``remote_traceback`` its traceback in the stage process.
    """

    def __init__(self, stage: int, op: str, micro_batch: int | None, message: str,
                 remote_traceback: str = "", original: BaseException | None = None,
                 replica: int | None = None) -> None:
        self.original = original
        self.__cause__ = original
        self.stage = stage
        self.op = op
        self.micro_batch = micro_batch
        self.message = message
        self.remote_traceback = remote_traceback
        self.replica = replica
        where = ("" if replica is None else f"replica {replica}, ") + f"stage {stage}, op {op}" + (
            "" if micro_batch is None else f", micro-batch {micro_batch}")
        super().__init__(f"{where}: {message}")

    def __reduce__(self):  # keep the fields across Ray's pickling
        return (type(self), (self.stage, self.op, self.micro_batch, self.message,
                             self.remote_traceback, _picklable(self.original), self.replica))


class StepAborted(StageError):
    """A stage stopped its step because another stage failed: the consequence,
    never the cause. The driver reports the cause (a plain :class:`StageError`)
    when one exists."""


class BoundaryShapeChanged(StageError):
    """What a stage sends across a boundary no longer has the signature learned for its
    message key (``boundary_shapes="learned"``: a tensor's dtype and shape, or a tree's
    layout, recorded the first time the key crossed, with headers): the sender sent nothing
    of it and the step failed as any failing stage fails it, changing nothing. ``keys``: the
    message keys (:func:`raypipe.core.ops.message_key`) to mark dynamic on every worker
    (:meth:`raypipe.comm.p2p.P2PChannel.mark_dynamic`) so that they keep headers; ``peer``
    the stage it was sent to; ``before`` and ``after`` the signatures, as text."""

    def __init__(self, stage: int, peer: int, micro_batch: int | None, before: str, after: str,
                 keys: tuple[int, ...], replica: int | None = None, remote_traceback: str = "",
                 original: BaseException | None = None) -> None:
        self.peer, self.before, self.after, self.keys = peer, before, after, tuple(keys)
        super().__init__(stage, "send", micro_batch, "", remote_traceback, original, replica)
        where = "" if replica is None else f"replica {replica}, "
        self.message = (f"{where}stage {stage}'s output to stage {peer}"
                        + ("" if micro_batch is None else f", micro-batch {micro_batch}")
                        + f", changed from {before} to {after}\n"
                        f"(boundary_shapes=\"learned\" sends the signature the first time a message key "
                        f"crosses and the payload only afterwards; message key(s) {list(self.keys)} are "
                        f"to keep headers: retry the step with them marked dynamic, or set "
                        f"boundary_shapes=\"headers\" for a model whose boundary shapes depend on the data)")
        self.args = (self.message,)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # keep the fields across Ray's pickling
        return (type(self), (self.stage, self.peer, self.micro_batch, self.before, self.after, self.keys,
                             self.replica, self.remote_traceback, _picklable(self.original)))


def _picklable(error: BaseException | None) -> BaseException | None:
    """The error itself if it survives pickling, else a RuntimeError with its text."""
    import pickle

    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure gets the fallback
        return RuntimeError(f"{type(error).__name__}: {error}")


class NonFiniteError(RaypipeError):
    """A step's loss or gradients were not finite and ``nonfinite="raise"``: no
    worker applied it. ``stage`` is the first stage whose gradient was non-finite
    (None when only the loss was)."""

    def __init__(self, step: int, stage: int | None, reason: str) -> None:
        self.step, self.stage, self.reason = step, stage, reason
        where = "the loss" if stage is None else f"stage {stage}'s gradients (the first non-finite stage)"
        super().__init__(f"step {step}: non-finite {where}; {reason}. No worker applied the step "
                         '(nonfinite="skip" would skip it and go on)')

    def __reduce__(self):
        return (type(self), (self.step, self.stage, self.reason))


class PlacementError(RaypipeError):
    """The cluster cannot hold the requested stage actors; ``unplaced`` lists the
    workers (by rank) that could not be placed, when some were."""

    def __init__(self, message: str, unplaced: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.unplaced = unplaced


class CheckpointError(RaypipeError):
    """A checkpoint file is missing, unreadable or damaged; ``path`` names it."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"checkpoint file {path} {problem}")

    def __reduce__(self):  # keep the fields across Ray's pickling
        return (type(self), (self.path, self.problem))


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that does not fit the model it is loaded into (another model's, or
    another size's): its files are intact, so an older checkpoint is no remedy.
    ``where`` names the stage and its layers, ``problem`` the first tensor that does
    not fit, ``path`` the checkpoint."""

    def __init__(self, path: str, where: str, problem: str) -> None:
        self.path, self.where, self.problem = path, where, problem
        RaypipeError.__init__(self, f"{where}: {problem} (checkpoint {path}; is it of another model?)")

    def __reduce__(self):
        return (type(self), (self.path, self.where, self.problem))


def place_name(place: tuple[int, ...]) -> str:
    """``replica 0 stage 1``, with ``tp_rank 1`` after it for a tensor-parallel worker's place:
    how errors and failure events name a worker."""
    replica, stage, *tensor_parallel = place
    return f"replica {replica} stage {stage}" + "".join(f" tp_rank {tp_rank}" for tp_rank in tensor_parallel)


class WorkersFailed(RaypipeError):
    """Workers died, became unreachable or hung during a step. Nothing of the step
    was kept; the trainer heals this (replaces them, rolls every worker back to a
    snapshot, redoes the step) while ``max_failures`` allows.

    ``workers`` maps each failed worker's place to why: "died", "unreachable" or "hung";
    a place is (replica, stage), and (replica, stage, tp_rank) with tensor parallelism
    (:meth:`raypipe.core.topology.Topology.place`)."""

    def __init__(self, step: int, workers: dict[tuple[int, ...], str], detail: str = "") -> None:
        self.step, self.workers, self.detail = step, dict(workers), detail
        named = ", ".join(f"{place_name(place)} {why}" for place, why in sorted(workers.items()))
        super().__init__(f"step {step}: {named}" + (f" ({detail})" if detail else ""))

    def __reduce__(self):
        return (type(self), (self.step, self.workers, self.detail))


class WorkersLost(RaypipeError):
    """Workers of the running group found dead, unreachable or hung while the driver waited on
    calls to them outside a step (a heal's state transfer, a group re-formed, a grow):
    ``ranks`` maps each one's rank in the group to why ("died", "unreachable" or "hung").
    A layout change folds it into the heal under way as :class:`WorkersFailed`. Without the
    watch, a call to a stopped (SIGSTOPped, wedged) worker returns only once gRPC's keepalive
    gives up on it, minutes later."""

    def __init__(self, ranks: dict[int, str]) -> None:
        self.ranks = dict(ranks)
        super().__init__("workers found lost while the driver waited on calls to them: " + ", ".join(
            f"rank {rank} {why}" for rank, why in sorted(self.ranks.items())))

    def __reduce__(self):
        return (type(self), (self.ranks,))


class TooManyFailures(RaypipeError):
    """More failure events than ``max_failures``; ``failures`` lists every one."""

    def __init__(self, max_failures: int, failures: list[str]) -> None:
        self.max_failures, self.failures = max_failures, list(failures)
        listed = "\n".join(f"  {number}. {failure}" for number, failure in enumerate(failures, 1))
        super().__init__(f"{len(failures)} failures, more than max_failures={max_failures}; training stopped "
                         f"(load_checkpoint resumes from the newest intact checkpoint):\n{listed}")

    def __reduce__(self):
        return (type(self), (self.max_failures, self.failures))


class DataAccessError(RaypipeError):
    """A worker that reads the dataset cannot use it where it runs; raised before step 0.

    ``path`` is the dataset, ``where`` the worker (replica, stage) and its node
    (id and IP), ``problem`` what went wrong and ``advice`` what to do.
    """

    def __init__(self, path: str, where: object, problem: str, advice: str) -> None:
        self.path, self.where, self.problem, self.advice = path, where, problem, advice
        super().__init__(f"dataset {path}: {where} {problem}. {advice}.")
