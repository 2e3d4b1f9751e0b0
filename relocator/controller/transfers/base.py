"""What a transfer mode is to the state machine: one strategy object per `TransferMode`.

The machine (relocator.controller.machine) keeps the phase order; the strategy does the mode's
part of each phase: plan (is the mode possible, where the target's image goes), dump, transfer,
restore, after-switch, release, and the rollback's bookkeeping. `calls` names the mode's agent
calls for the Ray backend (a mixin RayBackend inherits); fakes implement the same methods."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from relocator.vocab import TransferMode

if TYPE_CHECKING:
    from relocator.controller.model import Relocation, WorkerRecord


class Context(Protocol):
    """What a strategy may use of the machine running it."""

    backend: Any  # relocator.controller.machine.Backend plus the mode's own calls
    store: Any  # relocator.controller.store.Store: the worker records
    postcopy_timeout_s: float
    handoff_window_s: float

    def save(self, rel: "Relocation") -> None: ...
    def target_alive(self, rel: "Relocation", when: str) -> None: ...


#: every mode's strategy, registered by its class's definition (TransferStrategy.__init_subclass__)
REGISTRY: dict[TransferMode, "TransferStrategy"] = {}


class TransferStrategy:
    """The defaults every mode shares; a mode overrides the phases it does differently.
    Defining a subclass with its own `mode` registers one instance of it (REGISTRY)."""

    mode: ClassVar[TransferMode]
    #: `auto` tries the modes by this rank, lowest first; None: `auto` never picks the mode
    auto_rank: ClassVar[int | None] = None
    #: a mode `auto` never picks: why (said in `auto`'s reason at PLAN, and by preflight)
    auto_why: ClassVar[str] = ""
    #: the mode freezes the source (HOLD, DUMP): False, the source serves on until SWITCH and a
    #: failure before it only removes the target copy (no resume, no router call back)
    freezes_source: ClassVar[bool] = True
    #: the phases in which the worker's new requests wait or its streams stall (a move's blackout)
    blackout_phases: ClassVar[tuple[str, ...]] = ("HOLD", "DUMP", "TRANSFER", "RESTORE", "SWITCH")
    #: the image was hashed byte by byte on arrival: RESTORE needs no second pass over it
    verified_on_arrival: ClassVar[bool] = False
    #: the source's image stays readable after RELEASE (a lost worker restarts from it warm)
    keeps_image: ClassVar[bool] = False
    #: the mode's agent calls for the Ray backend (a mixin of RayBackend), if any
    calls: ClassVar[type | None] = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "mode" in cls.__dict__:
            REGISTRY[cls.mode] = cls()

    # -- PLAN ---------------------------------------------------------------------------------
    def available(self, backend: Any, worker: "WorkerRecord", dst: str) -> tuple[bool, str]:
        """Whether the mode can move `worker` to `dst`, and why (for `auto`)."""
        return True, ""

    def check(self, backend: Any, worker: "WorkerRecord", dst: str) -> None:
        """An explicit request for this mode: raise PlanError if it cannot run."""

    def target_image(self, backend: Any, rel: "Relocation", worker: "WorkerRecord") -> tuple[str, str, str]:
        """(path, "tmpfs" | "disk", why) of the target's image directory. The target's copy
        lives only until it is restored: a tmpfs when the cluster's transient_images allows it."""
        return backend.transient_image_dir(worker, rel.dst, rel.id)

    # -- DUMP / TRANSFER / RESTORE ------------------------------------------------------------
    def dump(self, ctx: Context, rel: "Relocation") -> dict:
        info = ctx.backend.dump(rel.src, rel.src_cell, rel.image_dir)
        rel.image_bytes = int(info.get("bytes", 0))
        return info

    def transfer(self, ctx: Context, rel: "Relocation") -> dict:
        return ctx.backend.transfer(rel.src, rel.dst, rel.image_dir, rel.dst_image_dir)

    def restore(self, ctx: Context, rel: "Relocation") -> dict:
        return ctx.backend.restore(rel.dst, rel.dst_image_dir, rel.dst_cell, verified=self.verified_on_arrival,
                                   gpu_ids=rel.dst_gpu_ids or None)

    # -- SWITCH / RELEASE / rollback ----------------------------------------------------------
    def switch(self, ctx: Context, rel: "Relocation", worker: "WorkerRecord") -> dict:
        """Point the router's entry for the worker at the target (cutting its streams there)."""
        return ctx.backend.switch(worker.id, rel.dst_endpoint)

    def on_switch(self, ctx: Context, rel: "Relocation", worker: "WorkerRecord") -> None:
        """The router points at the target; `worker` still records the source."""

    def after_switch(self, ctx: Context, rel: "Relocation", switched_at: float) -> dict[str, Any]:
        """The worker record points at the target; extra figures for SWITCH's info."""
        return {}

    def release(self, ctx: Context, rel: "Relocation") -> dict[str, Any]:
        """Before the source is killed: wait for whatever the target still needs from it."""
        return {}

    def rollback(self, rel: "Relocation", worker: "WorkerRecord") -> None:
        """The worker record points back at the source: restore what the mode changed on it."""

    def before_reserve(self, ctx: Context, rel: "Relocation") -> None:
        """First thing in RESERVE, before the target's GPUs are held (a handoff favours its
        source from here: Ray starts a worker process on the target's node for the
        reservation). Best effort: must not raise; a rollback calls `source_back`."""

    def source_back(self, ctx: Context, rel: "Relocation") -> None:
        """A rollback left the source serving (resumed, or never stopped): undo what the mode did
        to the source's copy itself (a handoff's raised priority). Best effort: must not raise."""


__all__ = ["Context", "REGISTRY", "TransferStrategy"]
