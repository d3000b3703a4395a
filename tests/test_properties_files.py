"""Property-based tests: generated damage to the files a run or a client resumes from.

The files are written once per module by the code that writes them in a run: tensor files
(``durable.save_tensors``: float32, float16, bfloat16, int64 and bool tensors, the digest in
their metadata), the server's checkpoints (``RunDirectory.save_checkpoint``: a safetensors file
and the JSON record that commits it, with a DP release ledger and the evaluation-pending mark
in its metadata), a client's personal state (``ClientStateStore``, three rounds on disk) and
the privacy ledger (``privacy.json``). Each example damages one file the way disks and copies
do: cut at a drawn offset, one to four drawn bits flipped, a drawn burst of bytes overwritten,
garbage appended, or emptied. Then the file is read back as a resume reads it. Properties:

1. tensor files: ``load_tensors`` raises ``DamagedFileError`` naming the file, or returns
   exactly the tensors written (names, dtypes, shapes, bytes), with or without the digest the
   caller kept;
2. checkpoints: the newest checkpoint read is one that was written, exactly (tensors and
   record); a damaged newer one is reported by its file and skipped for the older one; with
   none intact, ``DamagedFileError`` names the damaged file;
3. client state: the state loaded is exactly the one saved for the round it reports; a
   damaged round's file is skipped (a warning names it) for the newest intact older round;
4. the privacy ledger: read back exactly as written, or ``DamagedFileError`` naming
   ``privacy.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfm_flower.privacy.ledger import LedgerFile, ReleaseLedger
from fedfm_flower.records.client_state import ClientStateStore
from fedfm_flower.records.durable import DamagedFileError, load_tensors, save_tensors, tensor_sha256
from fedfm_flower.records.results import RunDirectory
from tests.properties import examples

ROUNDS = 3


def tensors_of(seed: int) -> dict[str, torch.Tensor]:
    """A few small tensors of the dtypes states hold, seeded."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "global.adapter.a": torch.randn(3, 4, generator=generator),
        "global.head.w": torch.randn(5, generator=generator).to(torch.float16),
        "learner.proj": torch.randn(2, 3, generator=generator).to(torch.bfloat16),
        "round": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.randn(4, generator=generator) > 0,
    }


def client_tensors(seed: int) -> dict[str, torch.Tensor]:
    """``tensors_of`` without bfloat16, which a client's in-memory state (a Flower record of
    NumPy arrays) cannot hold."""
    return {n: t for n, t in tensors_of(seed).items() if t.dtype != torch.bfloat16}


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Equal names, dtypes, shapes and bytes."""
    return tensor_sha256(a) == tensor_sha256(b)


# ------------------------------------------------------------------------------ damage


@dataclass(frozen=True)
class Damage:
    """One way a file gets damaged."""

    kind: str  # "cut", "flip", "burst", "append", "empty"
    where: tuple[int, ...] = ()  # offsets (cut: one; flip: one per bit; burst: start)
    bits: tuple[int, ...] = ()  # flip: the bit of each offset
    data: bytes = b""  # burst: the bytes written; append: the bytes added

    def apply(self, original: bytes) -> bytes:
        """``original`` damaged (never equal to it)."""
        if self.kind == "cut":
            return original[: self.where[0]]
        if self.kind == "empty":
            return b""
        if self.kind == "append":
            return original + self.data
        damaged = bytearray(original)
        if self.kind == "flip":
            for offset, bit in zip(self.where, self.bits, strict=True):
                damaged[offset] ^= 1 << bit
        else:  # burst
            start = self.where[0]
            damaged[start : start + len(self.data)] = self.data
            damaged = damaged[: len(original)]
        return bytes(damaged)


def header_size(data: bytes) -> int:
    """Bytes of a safetensors file before its tensors: the 8-byte length, then the JSON header
    (names, dtypes, shapes, offsets and the metadata with the digest)."""
    return 8 + int.from_bytes(data[:8], "little")


@st.composite
def damages(draw: Any, size: int, header: int = 0) -> Damage:
    """A damage of a file of ``size`` bytes that changes it; with ``header`` > 0 (a tensor
    file's header size) also a bit flipped in the header and another in the tensors, the
    damage a digest in the header alone would miss where the flip hits its key."""
    kinds = ["flip", "cut", "burst", "append", "empty"] + (["header+data"] if header else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "header+data":
        offsets = (draw(st.integers(0, header - 1)), draw(st.integers(header, size - 1)))
        bits = (draw(st.integers(0, 7)), draw(st.integers(0, 7)))
        return Damage("flip", offsets, bits)
    if kind == "cut":
        return Damage(kind, (draw(st.integers(0, size - 1)),))
    if kind == "flip":
        spots = draw(
            st.lists(
                st.tuples(st.integers(0, size - 1), st.integers(0, 7)),
                min_size=1,
                max_size=4,
                unique=True,
            )
        )
        return Damage(kind, tuple(o for o, _ in spots), tuple(b for _, b in spots))
    if kind == "burst":
        start = draw(st.integers(0, size - 1))
        data = draw(st.binary(min_size=1, max_size=min(32, size - start)))
        return Damage(kind, (start,), data=data)
    if kind == "append":
        return Damage(kind, data=draw(st.binary(min_size=1, max_size=64)))
    return Damage(kind)


@dataclass
class Pristine:
    """A file's written bytes, restored after each example damages it."""

    path: Path
    data: bytes

    @contextlib.contextmanager
    def damaged(self, damage: Damage) -> Iterator[bool]:
        """The file with ``damage`` written, its bytes restored on exit; yields False when the
        damage changes nothing (a burst of the same bytes): the example has no damage to test."""
        damaged = damage.apply(self.data)
        try:
            self.path.write_bytes(damaged)
            yield damaged != self.data
        finally:
            self.path.write_bytes(self.data)


# ------------------------------------------------------------------------------ tensor files


@pytest.fixture(scope="module")
def tensor_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pristine, str]:
    """A tensor file as ``save_tensors`` writes it, and the digest it returned."""
    path = tmp_path_factory.mktemp("tensors") / "state.safetensors"
    digest = save_tensors(path, tensors_of(7))
    return Pristine(path, path.read_bytes()), digest


@settings(max_examples=examples(700))
@given(data=st.data(), kept_digest=st.booleans())
def test_a_damaged_tensor_file_is_refused_or_read_exactly(
    tensor_file: tuple[Pristine, str], data: st.DataObject, kept_digest: bool
) -> None:
    """As checkpoints read theirs (the digest kept in the record too) and as client state
    reads its own (``own``: the digest in the file's metadata only)."""
    pristine, digest = tensor_file
    size, header = len(pristine.data), header_size(pristine.data)
    with pristine.damaged(data.draw(damages(size, header))) as changed:
        if not changed:
            return
        try:
            loaded = load_tensors(pristine.path, digest if kept_digest else None, own=True)
        except DamagedFileError as err:
            assert err.path == pristine.path and str(pristine.path) in str(err)
            return
        assert same_tensors(loaded, tensors_of(7)), "a damaged file was read as another state"


# ------------------------------------------------------------------------------ checkpoints


def checkpoint_meta(server_round: int) -> dict[str, Any]:
    """What the runner commits with a round's tensors: the strategy's metadata (with a DP
    release ledger) and whether the round's evaluation is still to come."""
    ledger = ReleaseLedger("central", list(range(1, server_round + 1)))
    strategy = {"strategy": "FedAvgStrategy", "method": "fedavg", "privacy": ledger.to_json()}
    return {"strategy": strategy, "evaluation-pending": server_round % 2 == 1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunDirectory, list[Pristine]]:
    """A run directory with the checkpoints of rounds 1-3, and each file's bytes."""
    run = RunDirectory(tmp_path_factory.mktemp("run") / "run")
    run.checkpoint_dir.mkdir(parents=True)
    for server_round in range(1, ROUNDS + 1):
        run.save_checkpoint(
            server_round, tensors_of(server_round), checkpoint_meta(server_round), keep=ROUNDS
        )
    files = sorted(run.checkpoint_dir.iterdir())
    return run, [Pristine(p, p.read_bytes()) for p in files]


def _round_of(path: Path) -> int:
    return int(path.stem.split("_")[1])


@settings(max_examples=examples(700))
@given(data=st.data())
def test_a_damaged_checkpoint_is_skipped_for_an_older_one_never_loaded(
    checkpoints: tuple[RunDirectory, list[Pristine]], data: st.DataObject
) -> None:
    run, files = checkpoints
    pristine = data.draw(st.sampled_from(files), label="file")
    damaged_round = _round_of(pristine.path)
    with pristine.damaged(data.draw(damages(len(pristine.data)), label="damage")) as changed:
        if not changed:
            return
        reported: list[DamagedFileError] = []
        newest = run.load_newest_checkpoint(on_damaged=lambda r, err: reported.append(err))
        assert newest is not None
        server_round, tensors, meta = newest
        assert same_tensors(tensors, tensors_of(server_round)), "another state was loaded"
        sha = tensor_sha256(tensors_of(server_round))
        written = {"round": server_round, "sha256": sha, **checkpoint_meta(server_round)}
        assert meta == written, meta
        if server_round != ROUNDS:  # fell back: only past the damaged newest checkpoint
            assert damaged_round == ROUNDS and server_round == ROUNDS - 1
            assert [err.path.name for err in reported] == [pristine.path.name], reported


@pytest.fixture(scope="module")
def single_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[RunDirectory, list[Pristine]]:
    """A run directory with one checkpoint (round 1)."""
    run = RunDirectory(tmp_path_factory.mktemp("single") / "run")
    run.checkpoint_dir.mkdir(parents=True)
    run.save_checkpoint(1, tensors_of(1), checkpoint_meta(1), keep=1)
    files = sorted(run.checkpoint_dir.iterdir())
    return run, [Pristine(p, p.read_bytes()) for p in files]


@settings(max_examples=examples(200))
@given(data=st.data())
def test_a_damaged_only_checkpoint_is_an_error_naming_its_file(
    single_checkpoint: tuple[RunDirectory, list[Pristine]], data: st.DataObject
) -> None:
    run, files = single_checkpoint
    pristine = data.draw(st.sampled_from(files), label="file")
    with pristine.damaged(data.draw(damages(len(pristine.data)), label="damage")) as changed:
        if not changed:
            return
        try:
            newest = run.load_newest_checkpoint(on_damaged=lambda r, err: None)
        except DamagedFileError as err:
            assert pristine.path.name in str(err)
            return
        assert newest is not None
        _, tensors, meta = newest
        assert same_tensors(tensors, tensors_of(1))
        written = {"round": 1, "sha256": tensor_sha256(tensors_of(1)), **checkpoint_meta(1)}
        assert meta == written, meta


# ------------------------------------------------------------------------------ client state


@pytest.fixture(scope="module")
def client_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Pristine]]:
    """A client's state directory with its personal state of rounds 1-3."""
    root = tmp_path_factory.mktemp("client-state")
    store = ClientStateStore(RecordDict(), 4, "run", str(root), keep=ROUNDS)
    for server_round in range(1, ROUNDS + 1):
        store.save(server_round, client_tensors(10 + server_round))
    assert store.directory is not None
    files = sorted(store.directory.glob("round_*.safetensors"))
    assert len(files) == ROUNDS
    return root, [Pristine(p, p.read_bytes()) for p in files]


@pytest.fixture(scope="module")
def quiet_state_warnings() -> Iterator[list[str]]:
    """The warnings of ``fedfm_flower.records.client_state``, collected instead of logged."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("fedfm_flower.records.client_state")
    handler, propagate = Collect(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    yield seen
    logger.removeHandler(handler)
    logger.propagate = propagate


@settings(max_examples=examples(700))
@given(data=st.data())
def test_a_damaged_client_state_falls_back_to_an_older_round_never_loaded(
    client_state: tuple[Path, list[Pristine]],
    quiet_state_warnings: list[str],
    data: st.DataObject,
) -> None:
    root, files = client_state
    pristine = data.draw(st.sampled_from(files), label="file")
    damaged_round = _round_of(pristine.path)
    quiet_state_warnings.clear()
    damage = damages(len(pristine.data), header_size(pristine.data))
    with pristine.damaged(data.draw(damage, label="damage")) as changed:
        if not changed:
            return
        store = ClientStateStore(RecordDict(), 4, "run", str(root), keep=ROUNDS)
        loaded = store.load(before=ROUNDS + 1)
        if store.loaded_round == 0:  # nothing intact: only when round 1 alone was left
            assert loaded is None
            return
        assert loaded is not None
        assert same_tensors(loaded, client_tensors(10 + store.loaded_round)), "another state"
        if store.loaded_round != ROUNDS:
            assert damaged_round == ROUNDS and store.loaded_round == ROUNDS - 1
            assert any(str(pristine.path) in w for w in quiet_state_warnings)


# ------------------------------------------------------------------------------ privacy ledger


@pytest.fixture(scope="module")
def ledger_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Pristine]:
    """``privacy.json`` of a central-DP run after 12 releases (a round redone twice)."""
    directory = tmp_path_factory.mktemp("ledger")
    ledger = ReleaseLedger("central", [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 9, 10])
    LedgerFile(directory).keep(ledger)
    path = directory / "privacy.json"
    return directory, Pristine(path, path.read_bytes())


@settings(max_examples=examples(500))
@given(data=st.data())
def test_a_damaged_privacy_ledger_is_refused_or_read_exactly(
    ledger_file: tuple[Path, Pristine], data: st.DataObject
) -> None:
    directory, pristine = ledger_file
    written = json.loads(pristine.data)
    with pristine.damaged(data.draw(damages(len(pristine.data)))) as changed:
        if not changed:
            return
        try:
            ledger = LedgerFile(directory).read("central")
        except DamagedFileError as err:
            assert err.path == pristine.path and "privacy.json" in str(err)
            return
        assert ledger is not None
        assert ledger.to_json() == {k: written[k] for k in ("mode", "noise", "releases")}, (
            "a damaged ledger was read as another count of releases"
        )
