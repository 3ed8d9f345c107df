"""The shared kit for bitwise claims in the tests.

* :func:`bits` - ``zerodiff.rl.locate.bits``: an integer view of a tensor's bit patterns (floats by element size:
  float8 -> uint8, bf16/fp16 -> int16, fp32 -> int32, fp64 -> int64; integer tensors as they are), so
  ``torch.equal`` compares bits: ``-0.0 != +0.0`` and NaN payloads count, which value comparison would hide.
* :func:`assert_bitwise_equal` - equal bits and shape, else an AssertionError naming how many values differ,
  the first differing coordinate and both values there.
* :func:`assert_victim_in_batch` - a row computed alone equals the same row computed inside every batch given.
* :func:`assert_batch_dependent` - the negative control: at least one batch changes the victim's bits (a test
  whose control never differs proves nothing).
* :func:`assert_victims_in_batch` - several victims placed in one batch (victim ``j`` at ``positions[j]``): each
  row of the batched output equals that victim's output computed alone.
* :func:`victim_runs` - the ``(label, row)`` pairs the single-victim checks take, from a batch runner;
  :func:`placed_rows` - the ``(alone, label, row)`` triples of one batched output holding several victims.
* :func:`victim_batches` - the batches of a several-victims sweep: per round and batch size, a filler batch with
  victim ``j`` written at the ``j``-th of the first, middle and last rows (for :func:`assert_victims_in_batch`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence, Union

import torch

from zerodiff.rl.locate import bits  # the library's one bit view (also what `zerodiff locate` compares)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """'' when the bits agree, else 'N of M values differ; first at (i, j, ...): a=... b=...'."""
    ba, bb = bits(a), bits(b)
    if torch.equal(ba, bb):
        return ""
    diff = (ba != bb)
    where = tuple(int(i) for i in diff.nonzero()[0].tolist())
    return (f"{int(diff.sum())} of {a.numel()} values differ; first at {where}: "
            f"{a[where].item()!r} vs {b[where].item()!r}")


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    """``a`` and ``b`` have the same dtype, shape and bits."""
    prefix = f"{msg}: " if msg else ""
    assert a.dtype == b.dtype, f"{prefix}dtype {a.dtype} vs {b.dtype}"
    assert a.shape == b.shape, f"{prefix}shape {tuple(a.shape)} vs {tuple(b.shape)}"
    why = first_difference(a, b)
    assert not why, prefix + why


def assert_victim_in_batch(alone: torch.Tensor, in_batch: Iterable[tuple[str, torch.Tensor]]) -> None:
    """``alone`` (the victim's output computed by itself) equals every ``(label, output)`` computed inside a batch."""
    n = 0
    for label, out in in_batch:
        assert_bitwise_equal(out, alone, f"victim {label}")
        n += 1
    assert n > 0, "no batch given: the claim was not tested"


def assert_batch_dependent(alone: torch.Tensor, in_batch: Iterable[tuple[str, torch.Tensor]],
                           what: str = "stock path") -> list[str]:
    """The negative control: some batch changes the victim's bits. Returns the labels that differ."""
    differ = [label for label, out in in_batch if first_difference(out, alone)]
    assert differ, f"{what}: the victim's bits never changed with the batch; this control proves nothing"
    return differ


def victim_runs(run: Callable[[torch.Tensor], torch.Tensor], victim: torch.Tensor,
                batches: Iterable[tuple[torch.Tensor, int]]) -> Iterable[tuple[str, torch.Tensor]]:
    """For each ``(batch, pos)`` (the victim's row already placed at ``pos``), ``(label, run(batch)[pos])``."""
    for batch, pos in batches:
        yield f"at {pos} of {batch.shape[0]}", run(batch)[pos:pos + 1]


def placed_rows(out: torch.Tensor, alone: Sequence[torch.Tensor], positions: Sequence[int],
                label: str = "") -> list[tuple[torch.Tensor, str, torch.Tensor]]:
    """Several victims in one batched output: victim ``j`` (computed alone as ``alone[j]``, one row) was placed at
    ``positions[j]``. Returns ``(alone[j], label, out[p:p + 1])`` per victim; positions beyond ``len(alone)`` are an
    error (a victim without its alone output would go unchecked)."""
    assert len(positions) <= len(alone), f"{len(positions)} positions for {len(alone)} victims"
    tail = f", {label}" if label else ""
    return [(alone[j], f"{j} at {p} of {out.shape[0]}{tail}", out[p:p + 1]) for j, p in enumerate(positions)]


def assert_victims_in_batch(out: torch.Tensor, alone: Sequence[torch.Tensor], positions: Sequence[int],
                            label: str = "") -> None:
    """Every victim ``j`` placed at ``positions[j]`` of the batch has, in ``out``, the bits of ``alone[j]``."""
    rows = placed_rows(out, alone, positions, label)
    assert rows, "no victim placed: the claim was not tested"
    for a, lab, row in rows:
        assert_victim_in_batch(a, [(lab, row)])


def spread_positions(m: int) -> list[int]:
    """The first, middle and last row of an ``m``-row batch (fewer when they coincide)."""
    return sorted({0, m // 2, m - 1})


def victim_batches(victims: torch.Tensor, sizes: Iterable[int],
                   fill: Union[torch.Tensor, Callable[[int, int], torch.Tensor]],
                   rounds: int = 2) -> Iterator[tuple[int, int, list[int], torch.Tensor]]:
    """For each round and each batch size ``m`` in ``sizes``: ``(round, m, positions, batch)`` where ``batch`` is the
    filler with ``victims[j]`` written at ``positions[j]`` (:func:`spread_positions`). ``fill`` is either a callable
    ``fill(m, round) -> fresh m-row batch`` or a pool tensor (round 0 takes its first ``m`` rows, later rounds the
    same rows in reverse order)."""
    sizes = tuple(sizes)
    for rnd in range(rounds):
        for m in sizes:
            pos = spread_positions(m)
            if callable(fill):
                b = fill(m, rnd)
            else:
                b = fill[:m].clone() if rnd == 0 else fill[:m].flip(0).clone()
            for j, p in enumerate(pos):
                b[p] = victims[j]
            yield rnd, m, pos, b
