"""The background fill of an asynchronous save's snapshot set: the copy in a thread of its own,
the flag the checkpoint writer's process waits for, and the check at finalize
([Note: background fill] in save_snapshot.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import Callable, List, Optional

import torch

# The writer's wait for a background fill (`writer_waits`): poll interval, and how long it waits
# before it writes anyway (the training process then refuses to finalize the save: `check_written`).
FILL_POLL_S = 0.001
FILL_TIMEOUT_S = 600.0


def shared(tensor: torch.Tensor, by_name: bool) -> torch.Tensor:
    """`tensor` moved into shared memory (its pages faulted in now): by file name (torch's
    `file_system` strategy) or as the current strategy shares it."""
    if by_name:
        tensor.untyped_storage()._share_filename_cpu_()
        return tensor
    return tensor.share_memory_()


def fill_piece(dst: torch.Tensor, src: torch.Tensor, scale: Optional[torch.Tensor]) -> None:
    dst.copy_(src)  # (same dtype: a memory copy; fp16 / bf16 into fp32: TE's `.float()`)
    if scale is not None:
        dst.mul_(scale)  # (TE's `unscaled.mul_(scale)`)


def fill_pieces(pieces: list, threads: int) -> None:
    if threads <= 1 or len(pieces) <= 1:
        for piece in pieces:
            fill_piece(*piece)
        return
    with concurrent.futures.ThreadPoolExecutor(min(threads, len(pieces))) as pool:
        list(pool.map(lambda piece: fill_piece(*piece), pieces))


class Fill:
    """One set's copy running in a thread of its own (`SaveSnapshots.take` with `background`),
    from `start()` on: megatron_saves starts it once the save's request is with the writer, so
    that the copy does not compete with the rest of the save on the training thread; anything
    that waits for it (`join`, `wait`) starts it first, so a fill nobody started never blocks.
    `flag` is two shared-memory bytes: the first, which the writer's process polls
    (`writer_waits`), 0 until the copy has finished, 1 once every byte is in the set, -1 if the
    copy failed; the second set by a writer that stopped waiting (FILL_TIMEOUT_S)."""

    def __init__(self, targets: List[torch.Tensor], pieces: list, threads: int,
                 before: Optional[Callable[[], None]], start: bool = True):
        self.storages = frozenset(t.untyped_storage().data_ptr() for t in targets)
        self.flag = shared(torch.zeros(2, dtype=torch.int8), by_name=True)
        self.error: Optional[BaseException] = None
        self._pieces = pieces
        self._thread = threading.Thread(target=self._run, args=(threads, before), daemon=True,
                                        name="megatron-offload-snapshot-fill")
        self._start_lock = threading.Lock()
        self.started = False
        if start:
            self.start()

    def start(self) -> None:
        """Start the copy (once; later calls do nothing). Never raises: a thread that cannot be
        started fails the fill (flag -1, `error`), so that a writer already handed its flag
        stops waiting and the save fails at finalize (`check_written`)."""
        with self._start_lock:
            if self.started:
                return
            try:
                self._thread.start()
            except BaseException as err:  # noqa: BLE001  (reported by `wait`, in the training process)
                self.error = err
                self.flag[0] = -1
            # (set once the thread runs: `done` must not read a fill about to start as finished)
            self.started = True

    def _run(self, threads: int, before) -> None:
        try:
            if before is not None:
                before()
            fill_pieces(self._pieces, threads)
            # (The copies' stores come before this one in this thread, and the writer reads the
            # set in threads it starts after seeing the flag: a thread start orders memory there.)
            self.flag[0] = 1
        except BaseException as err:  # noqa: BLE001  (reported by `wait`, in the training process)
            self.error = err
            self.flag[0] = -1
        finally:
            self._pieces = None  # (views of the set: it counts as free again once a save lets go)

    @property
    def done(self) -> bool:
        return self.started and not self._thread.is_alive()

    def join(self) -> None:
        self.start()
        if self._thread.ident is not None:  # (else it could not be started: failed, nothing to wait for)
            self._thread.join()

    def wait(self) -> None:
        """Block until the copy has finished; raise if it failed (the set's bytes are not the state's)."""
        self.join()
        if self.error is not None:
            raise RuntimeError(f"megatron-offload: filling an asynchronous save's snapshots failed: "
                               f"{self.error!r}; the save must not be used") from self.error

    def check_written(self) -> None:
        """After the writer has run: raise if it may have written the set before it was filled."""
        self.wait()
        if int(self.flag[1]) != 0:
            raise RuntimeError(
                f"megatron-offload: the checkpoint writer stopped waiting for an asynchronous save's "
                f"snapshots after {FILL_TIMEOUT_S:.0f} s and wrote them as they were; the save must not be used")


def writer_waits(flags: List[torch.Tensor], write: Callable, *args, **kwargs):
    """Call `write(*args, **kwargs)` once every flag is set (`Fill.flag`): run in the checkpoint
    writer's process, as the writer's function (megatron_saves wraps megatron-core's request in
    it). Never raises for a failed or late fill (that would end megatron-core's worker loop, and a
    blocking finalize would wait for ever): it writes after FILL_TIMEOUT_S anyway, and the
    training process refuses to finalize that save (`check_written`, a finalize function)."""
    deadline = time.monotonic() + FILL_TIMEOUT_S
    for flag in flags:
        while int(flag[0]) == 0:
            if time.monotonic() > deadline:
                flag[1] = 1
                break
            time.sleep(FILL_POLL_S)
    return write(*args, **kwargs)


def check_written(fills: List[Fill]) -> None:
    """A finalize function of every asynchronous save in background mode, on every rank (`fills`:
    what this rank's writer waited for, maybe none): raise, on every rank of an initialized
    process group, before the save is finalized, if any rank's fill failed or its writer
    stopped waiting (`Fill.check_written`); one rank raising alone would leave the others in
    megatron-core's collective finalize."""
    problem = None
    for fill in fills:
        try:
            fill.check_written()
        except RuntimeError as err:
            problem = problem or err
    failed = problem is not None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        on_gpu = "nccl" in str(torch.distributed.get_backend())
        count = torch.tensor([int(failed)], dtype=torch.int32,
                             device=torch.cuda.current_device() if on_gpu else "cpu")
        torch.distributed.all_reduce(count)
        failed = int(count.item()) > 0
    if problem is not None:
        raise problem
    if failed:
        raise RuntimeError("megatron-offload: another rank's asynchronous save snapshots were not written as "
                           "filled; the save must not be used")


@contextlib.contextmanager
def handed_over_by_name():
    """Within it torch pickles CPU storages by file name (its `file_system` strategy), as the
    sets of background mode are shared: a request scheduled inside crosses to the writer's
    process without a file descriptor per tensor. (Pickled under the other strategy such a
    storage would first be copied into new shared memory.) Process-wide while it lasts."""
    import torch.multiprocessing as mp

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(previous)
