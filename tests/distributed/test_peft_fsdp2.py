"""FSDP2-sharded adapters reload CPU-first: each rank reads and copies only its own shard."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("peft")

from tests.distributed import workers_peft
from tests.spawn import run_on_ranks


def test_sharded_adapters_reload_their_local_shards(tmp_path):
    from accelerate_memsafe.integrations.peft import adapter_parameter_map

    model = workers_peft.build_peft_model(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "ckpt")
    full = {name: t.detach().clone() for name, t in model.state_dict().items()}
    expected = {n for n, _ in model.named_parameters() if ".lora_" in n or ".modules_to_save." in n}
    names = {name for a in ("default", "other") for name, _ in adapter_parameter_map(model, a).values()}
    assert names == expected

    results = run_on_ranks(workers_peft.reload_sharded_adapter, 2, timeout=240, ckpt=str(tmp_path / "ckpt"))
    uneven = 0
    for name in expected:
        chunks = torch.chunk(full[name], 2, dim=0)
        chunks = chunks + (full[name][full[name].shape[0]:],) * (2 - len(chunks))
        for rank, res in enumerate(results):
            p = res["params"][name]
            assert p["placements"] == ["S(0)"], name
            assert torch.equal(p["local"], chunks[rank]), f"rank {rank} shard of {name}"
        uneven += chunks[0].shape[0] != chunks[1].shape[0]
    assert uneven > 0  # odd LoRA ranks exercise the uneven last shard
    for res in results:
        # each rank read only its shard: bytes copied are about half the adapter, one shard at a time
        total = sum(full[n].numel() * full[n].element_size() for n in expected)
        assert res["copied"] < 0.6 * total
        largest = max(full[n].numel() * full[n].element_size() for n in expected)
        assert res["largest"] <= largest
        assert res["peak"] <= 1.05 * largest
