"""Exact resume on 2 gloo ranks (FSDP2, SHARDED) of ``StatefulDataLoader(..., shuffle=True,
generator=torch.Generator().manual_seed(9))``: after ``load_state`` in a fresh process group every rank
gets the batches of the uninterrupted run, for the rest of the epoch and the next one (stock accelerate
does not: the DataLoader draws its base seed from the same generator before the replayed permutation)."""

from __future__ import annotations

from tests.distributed import workers_resume_generator
from tests.spawn import run_on_ranks


def test_shuffled_stateful_dataloader_with_a_generator_resumes_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run = workers_resume_generator.batches_around_a_resume
    reference = run_on_ranks(run, 2, init_process_group=False, timeout=300, ckpt=ckpt, phase="save", stock=False)
    resumed = run_on_ranks(run, 2, init_process_group=False, timeout=300, ckpt=ckpt, phase="resume", stock=False)
    for rank in range(2):
        assert len(reference[rank]) == 17  # 7 left in the epoch, then 10
        assert resumed[rank][:17] == reference[rank], f"rank {rank}: the batches after the resume differ"
