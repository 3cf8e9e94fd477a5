"""Exclusive claims on grid points: of all the workers that may start one point (a sweep run twice, SLURM array
tasks, a requeued task), one runs it; a dead worker's point is taken over.

A claim is a chain of versioned files in the point's run directory, `claim.<version>.json`, each holding who runs
the point (job id, host, pid, a token unique to this claim) and a heartbeat timestamp. The newest version is the
claim. Every change (a first claim, a heartbeat, a takeover, a release) publishes version n+1 as a whole file with
`os.link` from a temporary file (the link fails when the name exists: O_CREAT|O_EXCL semantics, and NFS-safe), so
of all the workers that read version n and try to publish n+1, exactly one succeeds. A holder that fails to publish
its next heartbeat has lost the claim (another worker took it over) and stops its point. Only the two newest
versions are kept.

A claim is *free* when there is none or its holder released it, *live* while its heartbeat is younger than
`stale_after_s`, and *stale* (taken over by the next claimer) when older, when its holder's pid is gone on this
same host (boot), or when it was made by this same SLURM task (a requeued task resumes its own point).
Heartbeats are wall-clock times of the holder's host: the hosts' clocks must agree within much less than
`stale_after_s` (NTP), and a holder must refresh more often than that (`Heartbeat`, every `heartbeat_s`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

CLAIM_PATTERN = re.compile(r"^claim\.(\d+)\.json$")
STALE_AFTER_S = 300.0
HEARTBEAT_S = 30.0


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return ""


HOST = socket.gethostname()
BOOT_ID = _boot_id()


@dataclasses.dataclass(frozen=True)
class ClaimRecord:
    """One version of a point's claim, as stored in claim.<version>.json."""

    version: int
    token: str
    job_id: str
    host: str
    boot_id: str
    pid: int
    started: float
    heartbeat: float
    released: bool = False

    def describe(self, now: float | None = None) -> str:
        """"job J on host H (pid P), heartbeat N s ago"."""
        age = (time.time() if now is None else now) - self.heartbeat
        return f"job {self.job_id} on host {self.host} (pid {self.pid}), heartbeat {age:.0f} s ago"

    def state(self, stale_after_s: float, now: float | None = None, job_id: str | None = None) -> str:
        """"free" (released), "live" or "stale", as seen by a claimer of `job_id` (see the module docstring)."""
        now = time.time() if now is None else now
        if self.released:
            return "free"
        if now - self.heartbeat > stale_after_s:
            return "stale"
        if self.host == HOST and self.boot_id == BOOT_ID and not _alive(self.pid):
            return "stale"
        if job_id is not None and job_id == self.job_id and is_slurm_job(job_id) and self.pid != os.getpid():
            return "stale"
        return "live"


def is_slurm_job(job_id: str) -> bool:
    """Whether `job_id` names a SLURM job or array task ("123", "123_4"), not a local worker ("local-...")."""
    return re.fullmatch(r"\d+(_\d+)?", job_id) is not None


def local_job_id() -> str:
    """The job id a worker outside SLURM claims under."""
    return f"local-{HOST}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _versions(directory: Path) -> list[int]:
    with contextlib.suppress(FileNotFoundError):
        return sorted(int(match.group(1)) for name in os.listdir(directory)
                      if (match := CLAIM_PATTERN.match(name)))
    return []


def _path(directory: Path, version: int) -> Path:
    return directory / f"claim.{version}.json"


def current_claim(directory: str | Path, stale_after_s: float = STALE_AFTER_S) -> ClaimRecord | None:
    """The newest version of the claim in `directory` (None: never claimed). A file that cannot be parsed (written
    through the O_EXCL fallback by a writer still at it, or killed mid-write) is read as a claim of unknown holder,
    live until it is `stale_after_s` old by its mtime."""
    directory = Path(directory)
    for _ in range(20):
        versions = _versions(directory)
        if not versions:
            return None
        path = _path(directory, versions[-1])
        try:
            text = path.read_text()
            mtime = path.stat().st_mtime
        except FileNotFoundError:  # pruned by its holder between the listing and the read: list again
            continue
        try:
            return ClaimRecord(**json.loads(text))
        except (ValueError, TypeError):
            return ClaimRecord(versions[-1], "", "?", "?", "", -1, mtime, mtime)
    raise RuntimeError(f"the claim in {directory} kept changing while read")


def _publish(directory: Path, record: ClaimRecord) -> bool:
    """Create claim.<record.version>.json whole; False when that version exists (another worker published it)."""
    final = _path(directory, record.version)
    temporary = directory / f".claim.{record.version}.{record.token}.tmp"
    temporary.write_text(json.dumps(dataclasses.asdict(record)) + "\n")
    try:
        os.link(temporary, final)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: exclusive create, then write (readers allow for it)
        try:
            descriptor = os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as handle:
            handle.write(temporary.read_text())
    finally:
        temporary.unlink(missing_ok=True)
    for version in _versions(directory):
        if version < record.version - 1:
            _path(directory, version).unlink(missing_ok=True)
    return True


class Claim:
    """A claim this worker holds on a point: `refresh` it more often than the stale timeout, `release` it at the
    end. `took_over`: the stale claim it replaced, if any."""

    def __init__(self, directory: Path, record: ClaimRecord, took_over: ClaimRecord | None) -> None:
        self.directory, self.record, self.took_over = directory, record, took_over
        self.lost = False

    def _next(self, **changes: object) -> bool:
        record = dataclasses.replace(self.record, version=self.record.version + 1, **changes)
        if self.lost or not _publish(self.directory, record):
            self.lost = True
            return False
        self.record = record
        return True

    def refresh(self, now: float | None = None) -> bool:
        """Publish a new heartbeat; False when the claim was lost (another worker took it over)."""
        return self._next(heartbeat=time.time() if now is None else now)

    def release(self) -> bool:
        """Give the point up (another worker may claim it at once); False if it had been lost already."""
        return self._next(heartbeat=time.time(), released=True)


def try_claim(directory: str | Path, job_id: str | None = None, stale_after_s: float = STALE_AFTER_S,
              now: float | None = None) -> Claim | None:
    """Claim the point in `directory` for `job_id` (default: `local_job_id()`): a Claim when this worker won it
    (new, released or stale before), None when another worker holds it live (`current_claim` says who)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    job_id = job_id or local_job_id()
    while True:
        held = current_claim(directory, stale_after_s)
        if held is not None and held.state(stale_after_s, now, job_id) == "live":
            return None
        moment = time.time() if now is None else now
        record = ClaimRecord(0 if held is None else held.version + 1, uuid.uuid4().hex, job_id, HOST, BOOT_ID,
                             os.getpid(), moment, moment)
        if _publish(directory, record):
            return Claim(directory, record, held if held is not None and not held.released else None)
        # another worker published this version first: read what it is (usually its live claim) and decide again


class Heartbeat:
    """While the block runs, refresh `claim` every `every_s` seconds from a thread; when a refresh finds the claim
    lost, call `on_lost` (e.g. kill the point's process) and stop. `lost` says whether that happened."""

    def __init__(self, claim: Claim, every_s: float = HEARTBEAT_S, on_lost: Callable[[], None] = lambda: None):
        self.claim, self.every_s, self.on_lost = claim, every_s, on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="claim-heartbeat", daemon=True)

    @property
    def lost(self) -> bool:
        return self.claim.lost

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            if not self.claim.refresh():
                self.on_lost()
                return

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
