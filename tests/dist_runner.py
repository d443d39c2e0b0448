"""The one way tests run code on several gloo ranks (NCCL ranks, one GPU each, with ``backend="nccl"``): a group of
spawned ranks that runs named scenario functions on request, each under a timeout. A rank's exception is raised
again in the test (with the rank's traceback); a hung rank is named, its stack dumped (faulthandler) and every rank
of the group killed. Groups live for the test session (process start and ``import torch`` are the slow part) and
are replaced after any failure. Usage: tests/README.md.

The benchmarks spawn their ranks with ``benchmarks.harness.spawn`` instead, on purpose: they measure each rank's
memory peak, gloo's threads included, so their ranks are fresh per run (a rank reused here carries the heap of the
scenarios before: malloc's arenas, gloo's buffers), start with the heap shim preloaded (``LD_PRELOAD``, fixed when
the process starts) and pin glibc's allocator before the process group exists. Reusing ranks is this runner's
point (starting them is the slow part), so one spawner would cost one side its speed or the other its figures.
``multinode_tests/nodes.py`` runs real torchrun agents, which neither spawner is.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from helpers import SCENARIO_TIMEOUT

# after one rank failed, how long its peers get to finish before they are taken as stuck in a collective with it
FAILURE_GRACE = 10.0


@dataclass
class RankContext:
    """What a scenario function receives on each rank (``fn(ctx, **kwargs)``)."""

    rank: int
    world: int
    store_path: str
    cache: dict = field(default_factory=dict)  # per-rank objects a scenario may reuse (a device mesh, ...)
    backend: str = "gloo"  # "nccl": rank r runs on cuda:r
    groups: int = 0  # process groups this rank has joined: each one rendezvous on a FileStore of its own

    def init_process_group(self) -> None:
        """For ``run_fresh(..., init=False)`` and ``Pool.run_before_group``: a scenario that must do something
        before the group exists."""
        import torch
        import torch.distributed as dist

        if self.backend == "nccl":  # NCCL needs one device per rank, chosen before the communicator exists
            torch.cuda.set_device(self.rank)
        store = f"{self.store_path}.{self.groups}"  # every rank joins its groups in the same order: the same file
        self.groups += 1
        dist.init_process_group(
            self.backend, store=dist.FileStore(store, self.world), rank=self.rank, world_size=self.world,
            # longer than the runner's timeout: the runner, not gloo, reports a hang, with each rank's stack
            timeout=datetime.timedelta(seconds=4 * SCENARIO_TIMEOUT),
        )

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def leave_group(self) -> None:
        """Destroy this rank's process group, and the objects cached on it (device meshes): a rank of the session
        becomes a process before its group, without paying for a new interpreter."""
        import gc

        import torch.distributed as dist

        from dist_optim._torch_internals import clear_sharding_cache

        self.cache.clear()
        gc.collect()
        if dist.is_initialized():
            clear_sharding_cache()  # else DTensor's cache hands this group's meshes to the next one's tensors
            dist.destroy_process_group()


class RankError(AssertionError):
    """A rank raised something that cannot travel back to the test process; the message holds its traceback."""


class RankDied(RuntimeError):
    """A rank process ended during a scenario (killed, crashed or exited)."""


class ScenarioTimeout(RuntimeError):
    """A scenario ran past its timeout; the message names the ranks that hung and shows where."""


class _RemoteTraceback(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _rank_main(rank: int, world: int, store_path: str, conn: Connection, dump_path: str, init: bool,
               backend: str) -> None:
    import torch
    import torch._dynamo  # noqa: F401 - DDP, FSDP2, DTensor import it at first use: loaded and frozen once here

    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # the modules' objects: gc's full collections (the scenarios', Python's own) skip them from now on
    dump = open(dump_path, "w")
    if hasattr(signal, "SIGUSR1"):  # the test process asks for every thread's stack when a scenario hangs
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    import torch.distributed as dist

    ctx = RankContext(rank, world, store_path, backend=backend)
    if init:
        ctx.init_process_group()
    conn.send(("ok", "ready"))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the test process is gone
            break
        if message is None:
            break
        fn, kwargs, before_group = message
        try:
            if before_group:
                ctx.leave_group()
            result = fn(ctx, **kwargs)
            if before_group:  # the next scenario finds a group up, as ever; a group the scenario left up is one
                ctx.cache.clear()
                if not dist.is_initialized():
                    ctx.init_process_group()
            conn.send(("ok", result))
        except BaseException as e:  # pytest.raises' "DID NOT RAISE" is no Exception
            text = "".join(traceback.format_exception(e))
            try:
                payload = pickle.dumps(e)
            except Exception:
                payload = None
            conn.send(("error", (payload, text)))
    if dist.is_initialized():
        dist.destroy_process_group()


def _name(fn: Callable, kwargs: dict) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}({args})"


class Group:
    """``world`` spawned ranks. ``init=True`` joins them in a process group of ``backend`` at start."""

    def __init__(self, world: int, *, init: bool = True, backend: str = "gloo") -> None:
        self.world = world
        self._dir = Path(tempfile.mkdtemp(prefix=f"dist_runner_{world}_"))  # own FileStore: parallel workers never meet
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs = []
        self._dumps = [self._dir / f"stack{r}.txt" for r in range(world)]
        for r in range(world):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_rank_main, args=(r, world, str(self._dir / "store"), child, str(self._dumps[r]), init, backend),
                name=f"rank{r}", daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self.broken = False
        self._started = False

    def run(self, fn: Callable, /, timeout: float = SCENARIO_TIMEOUT, *, before_group: bool = False,
            **kwargs) -> list:
        """Run ``fn(ctx, **kwargs)`` on every rank (``fn`` a module-level function, ``kwargs`` picklable); return
        each rank's result. Raises the first failing rank's exception, :class:`RankDied` or :class:`ScenarioTimeout`;
        after any of them the group is ``broken`` (ranks may be out of step) and closed. ``before_group``: the
        ranks leave their process group first (:meth:`RankContext.leave_group`), ``fn`` calls
        ``ctx.init_process_group()`` itself, and the ranks join a new group after it if it left none up."""
        if self.broken:
            raise RuntimeError("this group failed before: ask the pool for a new one")
        if not self._started:  # start-up (spawn, import torch, rendezvous) is not the scenario's time
            self._collect("start-up of the group", SCENARIO_TIMEOUT)
            self._started = True
        for conn in self._conns:
            conn.send((fn, kwargs, before_group))
        return self._collect(_name(fn, kwargs), timeout)

    def _collect(self, name: str, timeout: float) -> list:
        results: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        first_error: int | None = None
        dead: dict[int, int | None] = {}
        while len(results) + len(dead) < self.world:
            now = time.monotonic()
            if now >= deadline:
                break
            waiting = {c: r for r, c in enumerate(self._conns) if r not in results and r not in dead}
            sentinels = {self._procs[r].sentinel: r for r in waiting.values()}
            for ready in wait([*waiting, *sentinels], timeout=deadline - now):
                if ready in waiting:
                    r = waiting[ready]
                    try:
                        results[r] = ready.recv()
                    except EOFError:
                        continue  # its sentinel reports the death
                    if results[r][0] == "error" and first_error is None:
                        first_error = r
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
                else:
                    r = sentinels[ready]
                    if r not in results:
                        self._procs[r].join(1)
                        dead[r] = self._procs[r].exitcode
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
        if len(results) == self.world and first_error is None:
            return [results[r][1] for r in range(self.world)]
        self.broken = True
        hung = [r for r in range(self.world) if r not in results and r not in dead]
        stacks = self._stacks(hung)
        self.close()
        where = "".join(f"\n--- rank {r} was here:\n{stacks[r]}" for r in hung)
        failed = sorted(r for r in results if results[r][0] == "error")
        if dead:  # the cause; its peers' errors ("connection closed by peer") are consequences
            codes = ", ".join(f"rank {r}: {_exit(c)}" for r, c in sorted(dead.items()))
            also = f"; ranks {failed} then failed" if failed else ""
            raise RankDied(f"{name}: rank process ended ({codes}){also}; the others were killed{where}")
        if first_error is not None:
            payload, text = results[first_error][1]
            others = [r for r in failed if r != first_error]
            note = (f"rank {first_error} of {self.world} failed in {name}"
                    + (f"; ranks {others} failed too" if others else "")
                    + (f"; ranks {hung} then hung (killed)" if hung else "") + where)
            exc = None
            if payload is not None:
                try:
                    exc = pickle.loads(payload)
                except Exception:
                    exc = None
            if not isinstance(exc, BaseException):
                raise RankError(f"{note}\n{text}")
            exc.add_note(note)
            raise exc from _RemoteTraceback(f"\n[rank {first_error}]\n{text}")
        raise ScenarioTimeout(f"{name} ran past {timeout:.0f}s on {self.world} ranks; hung: ranks {hung} "
                              f"(finished: {sorted(results)}){where}")

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        if not ranks or not hasattr(signal, "SIGUSR1"):
            return {r: "(no stack: this platform has no SIGUSR1)" for r in ranks}
        for r in ranks:
            if self._procs[r].is_alive():
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        return {r: self._dumps[r].read_text() or "(no stack written)" for r in ranks}

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive() and not self.broken:
                try:
                    conn.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + (0 if self.broken else 3.0)  # one wait for all: gloo's teardown can stall
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


class Pool:
    """One live group per world size, kept for the session (the ``ranks`` fixture in conftest.py)."""

    def __init__(self, *, backend: str = "gloo") -> None:
        self.backend = backend
        self._groups: dict[int, Group] = {}

    def run(self, world: int, fn: Callable, /, timeout: float = SCENARIO_TIMEOUT, **kwargs) -> list:
        group = self._groups.get(world)
        if group is None or group.broken:
            group = self._groups[world] = Group(world, backend=self.backend)
        return group.run(fn, timeout, **kwargs)

    def run_before_group(self, world: int, fn: Callable, /, timeout: float = SCENARIO_TIMEOUT, **kwargs) -> list:
        """:meth:`run` for a scenario that must do something before ``init_process_group`` (attach an optimizer,
        build a model) and calls ``ctx.init_process_group()`` itself: the session's ranks leave their group for it
        instead of a group of new interpreters (``run_fresh(..., init=False)``), whose start is what such a test
        costs."""
        return self.run(world, fn, timeout, before_group=True, **kwargs)

    def close(self) -> None:
        for group in self._groups.values():
            if not group.broken:
                group.close()
        self._groups.clear()


def run_fresh(world: int, fn: Callable, /, timeout: float = SCENARIO_TIMEOUT, *, init: bool = True,
              backend: str = "gloo", **kwargs) -> list:
    """Run one scenario on a group of its own, closed afterwards: for a scenario that kills a rank, patches a
    library function, or must run code before ``init_process_group`` (``init=False``; it calls
    ``ctx.init_process_group()`` itself)."""
    group = Group(world, init=init, backend=backend)
    try:
        return group.run(fn, timeout, **kwargs)
    finally:
        if not group.broken:
            group.close()
