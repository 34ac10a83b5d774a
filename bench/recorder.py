"""What a worker process records: (due, start) per handler call, flushed to a file as it goes.

Imported by every benchmark worker (SDK, store layer, raw SQL, Procrastinate, Celery), so it
has no dependency beyond the standard library. A background thread appends the new pairs to
`<dir>/<role>-<pid>.rec` (native doubles) and rewrites `<role>-<pid>.count` ("count last_end")
every 0.1 s, so the parent can follow progress without querying anything and read latencies
even from a process it had to kill.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from collections import deque
from pathlib import Path

FLUSH_SECONDS = 0.1


class Recorder:
    def __init__(self, out_dir: str | os.PathLike[str], role: str) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = f"{role}-{os.getpid()}"
        self.rec_path = self.dir / f"{stem}.rec"
        self.count_path = self.dir / f"{stem}.count"
        # Pairs not yet on disk: a deque, whose append and popleft are safe across threads, so
        # memory stays flat however long the run (a list of every pair grew by ~100 bytes a run).
        self._pending: deque[tuple[float, float]] = deque()
        self._flushed = 0
        self.last_end = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-recorder", daemon=True)
        self._thread.start()

    def hit(self, due: float | None) -> None:
        """A handler got a job that was due at `due` (epoch seconds); it returns at once."""
        now = time.time()
        self._pending.append((due if due is not None else float("nan"), now))
        self.last_end = now

    def ready(self) -> None:
        (self.dir / f"ready-{os.getpid()}").touch()

    def flush(self) -> None:
        flat = array("d")
        while True:
            try:
                flat.extend(self._pending.popleft())
            except IndexError:
                break
        if flat:
            with open(self.rec_path, "ab") as out:
                flat.tofile(out)
            self._flushed += len(flat) // 2
        tmp = self.count_path.with_suffix(".tmp")
        tmp.write_text(f"{self._flushed} {self.last_end:.6f}")
        os.replace(tmp, self.count_path)

    def _loop(self) -> None:
        while not self._stop.wait(FLUSH_SECONDS):
            try:
                self.flush()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()  # one flusher at a time: _flushed is not updated atomically
        self.flush()


def wait_for_go(go_file: str | os.PathLike[str] | None, timeout: float = 600) -> None:
    """Block until the parent creates `go_file` (every worker starts at the same moment)."""
    if not go_file:
        return
    deadline = time.monotonic() + timeout
    path = Path(go_file)
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit("no go signal")
        time.sleep(0.005)


def read_progress(out_dir: str | os.PathLike[str]) -> tuple[int, float]:
    """Sum of the handler counts of every process in `out_dir`, and the latest handler end."""
    total, last = 0, 0.0
    for path in Path(out_dir).glob("*.count"):
        try:
            count, end = path.read_text().split()
        except (OSError, ValueError):
            continue
        total += int(count)
        last = max(last, float(end))
    return total, last


def read_pairs(out_dir: str | os.PathLike[str]) -> list[tuple[float, float]]:
    pairs: list[tuple[float, float]] = []
    for path in Path(out_dir).glob("*.rec"):
        flat = array("d")
        data = path.read_bytes()
        usable = len(data) - len(data) % (2 * flat.itemsize)
        flat.frombytes(data[:usable])
        pairs.extend(zip(flat[0::2], flat[1::2], strict=True))
    return pairs
