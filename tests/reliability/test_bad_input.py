"""Bad input never costs a parameter, an optimizer state or a file, and never passes silently.

Every case damages a checkpoint the way real runs do (an interrupted copy, a hand-edited index, a
checkpoint of another model, a malicious pickle, a full disk) and asserts, for every loader the plugin
offers or uses, a :class:`CheckpointError` whose message names the file / tensor / sizes, raised *before*
anything was modified: parameters, optimizer state and the checkpoint directory are snapshotted before
the call and compared bitwise after it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from accelerate_memsafe import CheckpointError, MemSafePlugin
from accelerate_memsafe.io import atomic, validate
from accelerate_memsafe.io.safetensors_source import SafetensorsSource
from tests.reliability import corrupt
from tests.reliability.corrupt import INDEX, assert_same, model_snapshot, optimizer_snapshot, tree_digest

LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


# -- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama saved with save_pretrained twice: one file, and sharded with an index."""
    from accelerate_memsafe.models import save_llama

    root = tmp_path_factory.mktemp("pretrained")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = save_llama(root / "single", "tiny")
        sharded = save_llama(root / "sharded", "tiny", max_shard_size=200_000)
    assert (sharded / INDEX).exists() and len(corrupt.shards(sharded)) >= 3
    return {"single": single, "sharded": sharded}


def _copy(src: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _expected_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    from accelerate_memsafe.models import build_llama

    return {k: tuple(v.shape) for k, v in build_llama("tiny").state_dict().items()}


# Each case: (id, layout, damage(directory) -> None, regex the message must match)
def _truncate_first(d: Path) -> None:
    corrupt.truncate(corrupt.shards(d)[0])


def _inflate_first(d: Path) -> None:
    corrupt.inflate_header(corrupt.shards(d)[0])


def _remove_last_shard(d: Path) -> None:
    os.remove(corrupt.shards(d)[-1])


def _wrong_shape(d: Path) -> None:
    corrupt.rewrite_tensors(corrupt.file_of(d, LM_HEAD), lambda t: t.__setitem__(LM_HEAD, t[LM_HEAD][:-1].clone()))


def _lossy_dtype(d: Path) -> None:
    def change(t):
        w = t[LM_HEAD].to(torch.float64)
        w[0, 0] = 1e300  # finite in float64, inf in the model's float32
        t[LM_HEAD] = w

    corrupt.rewrite_tensors(corrupt.file_of(d, LM_HEAD), change)


def _keys(d: Path) -> None:
    corrupt.drop_and_add_keys(d, LM_HEAD, "model.surplus.weight")


FILE_CASES = [
    ("truncated_shard", "sharded", _truncate_first, r"model-00001-of-0000\d\.safetensors.*truncated|truncated.*model-00001"),
    ("header_claims_more_bytes", "sharded", _inflate_first, r"model-00001-of-0000\d\.safetensors.*(truncated|corrupt)"),
    ("index_names_missing_shard", "sharded", _remove_last_shard, r"model.safetensors.index.json.*do(es)? not exist.*model-0000\d-of-0000\d"),
    ("index_escapes_dotdot", "sharded", lambda d: corrupt.escape_index(d, absolute=False), r"outside the checkpoint directory"),
    ("index_escapes_absolute", "sharded", lambda d: corrupt.escape_index(d, absolute=True), r"absolute path"),
    ("wrong_shape", "single", _wrong_shape, r"`lm_head.weight`.*\[255, 64\].*\[256, 64\]|`lm_head.weight`.*\(255, 64\).*\(256, 64\)"),
    ("lossy_dtype", "single", _lossy_dtype, r"`lm_head.weight`.*float64.*float32"),
    ("missing_and_unexpected_keys", "sharded", _keys, r"lm_head.weight.*model.surplus.weight|model.surplus.weight.*lm_head.weight"),
]


# -- accelerate_memsafe.from_pretrained ----------------------------------------------------------------------
@pytest.mark.parametrize("case", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_from_pretrained_refuses(case, pretrained, tmp_path):
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe import from_pretrained

    cid, layout, damage, pattern = case
    if cid == "missing_and_unexpected_keys":
        # a tensor of the checkpoint the model does not use is dropped with a warning, as transformers does
        # (`test_from_pretrained_drops_tensors_the_model_does_not_use`); the missing one is refused
        pattern = r"1 missing from the checkpoint: \['lm_head.weight'\]\. A checkpoint must hold every tensor"
    d = _copy(pretrained[layout], tmp_path)
    damage(d)
    before = tree_digest(tmp_path)
    with pytest.raises(CheckpointError, match=pattern), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_pretrained(AutoModelForCausalLM, d, dtype=torch.float32)
    assert tree_digest(tmp_path) == before


def test_from_pretrained_drops_tensors_the_model_does_not_use(pretrained):
    # a config that shrinks the model (the first layer of a checkpoint, to start a smaller model from it): the
    # checkpoint's other layers are not used; transformers drops them with a warning, and so does the loader, giving
    # bitwise transformers' model
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe import from_pretrained

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = from_pretrained(AutoModelForCausalLM, pretrained["sharded"], num_hidden_layers=1)
        want = AutoModelForCausalLM.from_pretrained(pretrained["sharded"], num_hidden_layers=1)
    assert got.config.num_hidden_layers == 1 and len(got.model.layers) == 1
    assert got.state_dict().keys() == want.state_dict().keys()
    assert all(torch.equal(t, want.state_dict()[n]) for n, t in got.state_dict().items())


# -- the rank0_distribute safetensors source -----------------------------------------------------------------
@pytest.mark.parametrize("case", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_safetensors_source_refuses(case, pretrained, tmp_path):
    cid, layout, damage, pattern = case
    if cid == "missing_and_unexpected_keys":
        # the source reads the tensors it is asked for; extra tensors in the file are ignored by design
        pattern = r"missing from the checkpoint: \['lm_head.weight'\]"
    d = _copy(pretrained[layout], tmp_path)
    damage(d)
    before = tree_digest(tmp_path)
    expected = {n: (s, torch.float32) for n, s in _expected_shapes(d).items()}
    with pytest.raises(CheckpointError, match=pattern):
        source = SafetensorsSource(d)
        try:
            source.validate(expected)
            for name in expected:  # what rank 0 then does: read every tensor into the model's dtype
                out = torch.empty(expected[name][0], dtype=torch.float32)
                out.copy_(source.read(name))
                validate.check_finite(name, out, where=str(d))
        finally:
            source.close()
    assert tree_digest(tmp_path) == before


# -- the shared validation helpers (what the loaders above should call) ------------------------------------
@pytest.mark.parametrize("case", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_validate_helpers_refuse(case, pretrained, tmp_path):
    from safetensors import safe_open

    _, layout, damage, pattern = case
    d = _copy(pretrained[layout], tmp_path)
    damage(d)
    before = tree_digest(tmp_path)
    with pytest.raises(CheckpointError, match=pattern):
        infos = validate.check_safetensors_checkpoint(d)
        validate.check_against_model(infos, _expected_shapes(d), where=str(d))
        for name, info in infos.items():
            with safe_open(info.file, framework="pt") as f:
                validate.check_cast(name, f.get_tensor(name), torch.float32, where=info.file)
    assert tree_digest(tmp_path) == before


def test_validate_accepts_a_good_checkpoint(pretrained):
    for layout in ("single", "sharded"):
        infos = validate.check_safetensors_checkpoint(pretrained[layout])
        validate.check_against_model(infos, _expected_shapes(pretrained[layout]), where="x")


def test_cast_loss_cases():
    assert validate.cast_loss(torch.tensor([1.5, -2.0]), torch.bfloat16) is None  # rounding is asked for
    assert "overflow" in validate.cast_loss(torch.tensor([7e4]), torch.float16)
    assert "fractional" in validate.cast_loss(torch.tensor([0.5]), torch.int64)
    assert "outside" in validate.cast_loss(torch.tensor([300]), torch.int8)
    assert "exact range" in validate.cast_loss(torch.tensor([2**25 + 1]), torch.float32)
    assert validate.cast_loss(torch.tensor([2**24]), torch.float32) is None


def test_keys_are_listed_by_name_not_counted():
    with pytest.raises(CheckpointError) as info:
        validate.check_keys(["a", "b", "c"], ["a", "x", "y"], where="ckpt")
    msg = str(info.value)
    assert "2 missing from the checkpoint: ['b', 'c']" in msg and "2 unexpected" in msg and "['x', 'y']" in msg


# -- RNG states: an allow-list of exactly the needed types ----------------------------------------------------
def _rng_file(path: Path) -> Path:
    import random

    import numpy as np

    states = {"step": 3, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
              "torch_manual_seed": torch.get_rng_state()}
    torch.save(states, path)
    return path


def test_rng_states_allow_list_is_exactly_what_is_needed(tmp_path):
    path = _rng_file(tmp_path / "random_states_0.pkl")
    states = validate.load_rng_states(path)
    assert states["step"] == 3 and torch.equal(states["torch_manual_seed"], torch.load(path, weights_only=False)["torch_manual_seed"])
    needed = validate.rng_state_globals()
    required = []
    for i, g in enumerate(needed):
        try:
            with torch.serialization.safe_globals(needed[:i] + needed[i + 1:]):
                torch.load(path, weights_only=True)
        except Exception:
            required.append(g)
    assert required == needed, f"not needed: {[g for g in needed if g not in required]}"


def test_rng_states_with_code_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "EXECUTED"
    path = _rng_file(tmp_path / "random_states_0.pkl")
    states = torch.load(path, weights_only=False)
    states["evil"] = corrupt.CodePayload(marker)
    torch.save(states, path)
    with pytest.raises(CheckpointError, match=r"random_states_0.pkl was refused.*system"):
        validate.load_rng_states(path)
    assert not marker.exists()


# -- Accelerator.load_state / save_state with the plugin (one process) -----------------------------------------
def _accelerator_setup(seed: int = 0):
    from accelerate_memsafe import Accelerator
    from accelerate_memsafe.models import build_llama

    acc = Accelerator(plugins=[MemSafePlugin(progress=False)], cpu=True)
    model = build_llama("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _train_step(acc, model, opt, seed: int) -> None:
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()


@pytest.fixture(scope="module")
def saved_state(tmp_path_factory):
    """A checkpoint written by ``save_state`` with the plugin after one training step."""
    from accelerate.state import AcceleratorState, GradientState

    root = tmp_path_factory.mktemp("state")
    acc, model, opt = _accelerator_setup()
    _train_step(acc, model, opt, 0)
    acc.save_state(str(root / "ckpt"))
    acc.wait_for_everyone()  # the files are copied in-process: wait for the background commit
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return root / "ckpt"


def _load_refused(d: Path, tmp_path: Path, pattern: str):
    acc, model, opt = _accelerator_setup(seed=1)
    _train_step(acc, model, opt, 1)
    before = (model_snapshot(model), optimizer_snapshot(opt), tree_digest(tmp_path))
    error = None
    try:
        acc.load_state(str(d))
    except Exception as exc:
        error = exc
    problems = []
    for what, old, new in (("model", before[0], model_snapshot(model)), ("optimizer", before[1], optimizer_snapshot(opt))):
        try:
            assert_same(old, new, what)
        except AssertionError as exc:
            problems.append(f"{exc} before the error")
    if tree_digest(tmp_path) != before[2]:
        problems.append("files were modified")
    if error is None:
        problems.append("load_state accepted the checkpoint (no error)")
    elif not isinstance(error, CheckpointError) or not re.search(pattern, str(error), re.S):
        problems.append(f"expected CheckpointError matching {pattern!r}, got {type(error).__name__}: {str(error)[:300]}")
    assert not problems, "; ".join(problems)


def _model_file_damage(kind: str):
    def damage(d: Path) -> None:
        f = d / "model.safetensors"
        if kind == "truncated":
            corrupt.truncate(f)
        elif kind == "header":
            corrupt.inflate_header(f)
        elif kind == "shape":
            corrupt.rewrite_tensors(f, lambda t: t.__setitem__(LM_HEAD, t[LM_HEAD][:-1].clone()))
        elif kind == "dtype":
            def change(t):
                w = t[LM_HEAD].to(torch.float64)
                w[0, 0] = 1e300
                t[LM_HEAD] = w
            corrupt.rewrite_tensors(f, change)
        elif kind == "keys":
            corrupt.rewrite_tensors(f, lambda t: (t.pop(LM_HEAD), t.__setitem__("model.surplus.weight", torch.zeros(3))))
    return damage


STATE_CASES = [
    # (id, damage, keep the plugin's marker consistent, pattern)
    ("truncated_model_file_marked", "truncated", False, r"model.safetensors.*(truncated|was modified)"),
    ("truncated_model_file_unmarked", "truncated", None, r"model.safetensors.*truncated"),
    ("header_claims_more_bytes", "header", True, r"model.safetensors.*(truncated|corrupt)"),
    ("wrong_shape", "shape", True, r"`?lm_head.weight`?.*255.*256|`?lm_head.weight`?.*256.*255"),
    ("lossy_dtype", "dtype", True, r"`lm_head.weight`.*float64.*float32"),
    ("missing_and_unexpected_keys", "keys", True, r"lm_head.weight.*model.surplus.weight|model.surplus.weight.*lm_head.weight"),
]


@pytest.mark.parametrize("case", STATE_CASES, ids=[c[0] for c in STATE_CASES])
def test_load_state_refuses_bad_model_file(case, saved_state, tmp_path):
    _, kind, keep, pattern = case
    d = _copy(saved_state, tmp_path)
    _model_file_damage(kind)(d)
    if keep is True:
        corrupt.remark(d)
    elif keep is None:
        (d / atomic.MARKER).unlink()  # a checkpoint written by stock accelerate has no marker
    _load_refused(d, tmp_path, pattern)


def test_load_state_refuses_per_rank_files_of_another_world_size(saved_state, tmp_path):
    d = _copy(saved_state, tmp_path)
    marker = json.loads((d / atomic.MARKER).read_text())
    marker["world_size"] = 2
    shutil.copy(d / "random_states_0.pkl", d / "random_states_1.pkl")
    for rank in range(2):  # FSDP LOCAL_STATE_DICT: one rank's flat shard each, tied to the world size
        torch.save({"flat_param": torch.zeros(4)}, d / f"pytorch_model_fsdp_rank{rank}.bin")
    (d / atomic.MARKER).write_text(json.dumps(marker))
    corrupt.remark(d)
    _load_refused(d, tmp_path, r"written by 2 process\(es\), but this run has 1.*pytorch_model_fsdp_rank0.bin cannot be "
                               r"resharded.*LOCAL_STATE_DICT.*--num_processes 2")


def test_load_state_refuses_optimizer_pickle_with_code(saved_state, tmp_path):
    marker = tmp_path / "EXECUTED"
    d = _copy(saved_state, tmp_path)
    state = torch.load(d / "optimizer.bin", weights_only=True)
    state["evil"] = corrupt.CodePayload(marker)
    torch.save(state, d / "optimizer.bin")
    corrupt.remark(d)
    _load_refused(d, tmp_path, r"optimizer.bin was refused: .*run code")
    assert not marker.exists(), "checkpoint code was executed"


def test_load_state_refuses_rng_pickle_with_code(saved_state, tmp_path):
    marker = tmp_path / "EXECUTED"
    d = _copy(saved_state, tmp_path)
    states = torch.load(d / "random_states_0.pkl", weights_only=False)
    states["evil"] = corrupt.CodePayload(marker)
    torch.save(states, d / "random_states_0.pkl")
    corrupt.remark(d)
    _load_refused(d, tmp_path, r"random_states_0.pkl.*refused")
    assert not marker.exists(), "checkpoint code was executed"


def _enospc_after(nbytes: int):
    """A safetensors ``save_file`` that writes ``nbytes`` of the file, then fails as a full disk does."""
    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * nbytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
    return save_file


def test_save_state_disk_full_keeps_the_previous_checkpoint(saved_state, tmp_path, monkeypatch):
    import accelerate.utils.other as acc_other

    d = _copy(saved_state, tmp_path)
    before = tree_digest(d)
    acc, model, opt = _accelerator_setup(seed=2)
    _train_step(acc, model, opt, 2)
    monkeypatch.setattr(acc_other, "safe_save_file", _enospc_after(4096))
    with pytest.raises(OSError, match=r"No space left on device.*model.safetensors") as info:
        acc.save_state(str(d))
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert tree_digest(d) == before, "the previous checkpoint was modified"
    atomic.check_loadable(d, world_size=1)
    leftover = atomic.temp_dir_for(d)
    if leftover.exists():
        with pytest.raises(CheckpointError, match="incomplete checkpoint"):
            atomic.check_loadable(leftover)
    # the previous checkpoint still loads bitwise
    from safetensors.torch import load_file

    acc.load_state(str(d))
    saved = load_file(str(d / "model.safetensors"))
    current = {k: v for k, v in acc.unwrap_model(model).state_dict().items() if k in saved}
    assert saved.keys() == current.keys() and all(torch.equal(saved[k], current[k]) for k in saved)


# -- reload_adapter ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("adapter")
    model = _peft_model(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(root / "ckpt")
    return root / "ckpt"


def _peft_model(seed: int):
    from peft import LoraConfig, get_peft_model

    from accelerate_memsafe.models import build_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        return get_peft_model(build_llama("tiny", seed=seed),
                              LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


LORA_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _adapter_damage(kind: str):
    def damage(d: Path) -> None:
        f = d / "adapter_model.safetensors"
        if kind == "truncated":
            corrupt.truncate(f)
        elif kind == "header":
            corrupt.inflate_header(f)
        elif kind == "shape":
            corrupt.rewrite_tensors(f, lambda t: t.__setitem__(LORA_A, t[LORA_A][:-1].clone()))
        elif kind == "dtype":
            def change(t):
                w = t[LORA_A].to(torch.float64)
                w[0, 0] = 1e300
                t[LORA_A] = w
            corrupt.rewrite_tensors(f, change)
        elif kind == "keys":
            corrupt.rewrite_tensors(f, lambda t: (t.pop(LORA_A), t.__setitem__("base_model.model.surplus.lora_A.weight", torch.zeros(3))))
    return damage


ADAPTER_CASES = [
    ("truncated", "truncated", r"adapter_model.safetensors.*truncated"),
    ("header_claims_more_bytes", "header", r"adapter_model.safetensors.*(truncated|corrupt)"),
    ("wrong_shape", "shape", r"adapter_model.safetensors.*`.*q_proj.lora_A.weight`.*shape \[3, 64\].*\[4, 64\]"),
    ("lossy_dtype", "dtype", r"q_proj.lora_A.weight`.*float64.*float32.*(lose|inf)"),
    ("missing_keys", "keys", r"adapter_model.safetensors.*(lacks|missing).*q_proj.lora_A"),
]


@pytest.mark.parametrize("case", ADAPTER_CASES, ids=[c[0] for c in ADAPTER_CASES])
def test_reload_adapter_refuses(case, adapter, tmp_path):
    from accelerate_memsafe import reload_adapter

    _, kind, pattern = case
    d = _copy(adapter, tmp_path)
    _adapter_damage(kind)(d)
    model = _peft_model(1)
    before = (model_snapshot(model), tree_digest(tmp_path))
    with pytest.raises(CheckpointError, match=pattern):
        reload_adapter(model, d)
    assert_same(before[0], model_snapshot(model), "model")
    assert tree_digest(tmp_path) == before[1]


# -- the verification after save_offloaded -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    """A tiny Llama dispatched on cpu + disk, and a first checkpoint saved from it with save_offloaded."""
    from accelerate_memsafe import save_offloaded
    from accelerate_memsafe.io.offload_reader import cpu_disk_device_map
    from accelerate_memsafe.models import build_llama, save_llama
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("offloaded")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_llama(root / "src", "tiny", seed=3)
        ref = build_llama("tiny", seed=3)
        model = AutoModelForCausalLM.from_pretrained(root / "src", device_map=cpu_disk_device_map(ref, 0.5),
                                                     offload_folder=str(root / "offload"))
    save_offloaded(model, root / "first", max_shard_size=100_000, progress=False)
    return model, root / "first", ref


def _bad_sync_file(kind: str):
    """The shard writer's last step on a finished file, followed by a corruption or a full disk."""
    from accelerate_memsafe.io.shard_writer import sync_file as real

    def sync_file(fd, path):
        real(fd, path)
        if kind == "truncated":
            corrupt.truncate(Path(path))
        elif kind == "header":
            corrupt.inflate_header(Path(path))
        elif kind == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return sync_file


OFFLOADED_CASES = [
    ("written_shard_truncated", "truncated", CheckpointError, r"model-0000\d-of-0000\d.safetensors.*(truncated|bytes on disk)"),
    ("written_header_claims_more_bytes", "header", CheckpointError, r"model-0000\d-of-0000\d.safetensors.*(truncated|bytes on disk|is F32)"),
    ("disk_full", "enospc", OSError, r"No space left on device.*model-0000\d-of-0000\d.safetensors"),
]


@pytest.mark.parametrize("case", OFFLOADED_CASES, ids=[c[0] for c in OFFLOADED_CASES])
def test_save_offloaded_verification_keeps_the_previous_checkpoint(case, offloaded, tmp_path, monkeypatch):
    from accelerate_memsafe import save_offloaded
    from accelerate_memsafe.io import shard_writer

    model, first, ref = offloaded
    _, kind, exc_type, pattern = case
    d = _copy(first, tmp_path)
    before = tree_digest(tmp_path)
    monkeypatch.setattr(shard_writer, "sync_file", _bad_sync_file(kind))
    with pytest.raises(exc_type, match=pattern):
        save_offloaded(model, d, max_shard_size=100_000, progress=False)
    monkeypatch.undo()
    assert tree_digest(tmp_path) == before, "the previous checkpoint (or its folder) was modified"
    atomic.check_loadable(d)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(d)
    expected = ref.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in reloaded.state_dict().items())


def test_from_pretrained_refuses_a_partial_checkpoint(pretrained, tmp_path):
    """What a killed ``save_offloaded`` leaves behind (a temporary directory with the sentinel) is refused."""
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe import from_pretrained

    temp = atomic.temp_dir_for(tmp_path / "ckpt")
    atomic.begin(temp)
    for f in pretrained["single"].iterdir():
        shutil.copy(f, temp / f.name)
    before = tree_digest(tmp_path)
    with pytest.raises(CheckpointError, match=r"\.memsafe-tmp-ckpt is an incomplete checkpoint"):
        from_pretrained(AutoModelForCausalLM, temp)
    assert tree_digest(tmp_path) == before


def _grown_model(acc_factory, extra: bool):
    """The tiny Llama (seed 1) with, when ``extra``, a new frozen module the checkpoint lacks, prepared with AdamW over
    the trainable parameters (the ones the checkpoint's optimizer state covers)."""
    from accelerate_memsafe.models import build_llama

    acc = acc_factory()
    model = build_llama("tiny", seed=1)
    if extra:
        model.extra_head = torch.nn.Linear(4, 4)
        model.extra_head.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def test_load_state_with_strict_false_loads_what_stock_loads(saved_state, tmp_path):
    # `load_state(dir, strict=False)` is passed to `load_state_dict`, which then takes a model with tensors the
    # checkpoint lacks (a module added since the save). Before, the plugin refused it ("2 missing from the
    # checkpoint"), where stock accelerate loads it; now both give the same model and optimizer, bitwise
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_memsafe import Accelerator

    got = {}
    for path, factory in (("stock", lambda: accelerate.Accelerator(cpu=True)),
                          ("plugin", lambda: Accelerator(plugins=[MemSafePlugin(progress=False)], cpu=True))):
        acc, model, opt = _grown_model(factory, extra=True)
        acc.load_state(str(_copy(saved_state, tmp_path, f"ckpt-{path}")), strict=False)
        got[path] = (model_snapshot(model), optimizer_snapshot(opt))
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert_same(got["stock"][0], got["plugin"][0], "model")
    assert_same(got["stock"][1], got["plugin"][1], "optimizer")
    from safetensors.torch import load_file

    saved = load_file(saved_state / "model.safetensors")  # every tensor the file holds is the model's now
    model = got["plugin"][0]
    assert [n for n, t in saved.items() if not torch.equal(model.get(f"param:{n}", model.get(f"buffer:{n}")), t)] == []
    assert "param:extra_head.weight" in model and "extra_head.weight" not in saved


def test_load_state_refuses_missing_tensors_by_default_and_names_strict_false(saved_state, tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_memsafe import Accelerator

    acc, model, opt = _grown_model(lambda: Accelerator(plugins=[MemSafePlugin(progress=False)], cpu=True), extra=True)
    before = (model_snapshot(model), optimizer_snapshot(opt))
    try:
        with pytest.raises(CheckpointError, match=r"2 missing from the checkpoint: \['extra_head.bias', "
                                                  r"'extra_head.weight'\].*pass `strict=False`"):
            acc.load_state(str(_copy(saved_state, tmp_path)))
        assert_same(before[0], model_snapshot(model), "model")
        assert_same(before[1], optimizer_snapshot(opt), "optimizer")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_load_state_with_strict_false_still_refuses_another_shape(saved_state, tmp_path):
    # `load_state_dict(strict=False)` raises for another shape too: the plugin refuses it before anything is modified
    d = _copy(saved_state, tmp_path)
    _model_file_damage("shape")(d)
    corrupt.remark(d)
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_memsafe import Accelerator

    acc, model, opt = _grown_model(lambda: Accelerator(plugins=[MemSafePlugin(progress=False)], cpu=True), extra=False)
    before = model_snapshot(model)
    try:
        with pytest.raises(CheckpointError, match=r"`lm_head.weight`: file \[255, 64\], model \[256, 64\]"):
            acc.load_state(str(d), strict=False)
        assert_same(before, model_snapshot(model), "model")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _resume_with(acc_factory, directory, *, lr, extra_group_entry=None, load_kwargs=None):
    """A fresh model and AdamW (``lr``; ``extra_group_entry`` added to its group), ``load_state(directory)``; the model
    and optimizer as loaded."""
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_memsafe.models import build_llama

    acc = acc_factory()
    model = build_llama("tiny", seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if extra_group_entry:
        opt.param_groups[0].update(extra_group_entry)
    model, opt = acc.prepare(model, opt)
    try:
        acc.load_state(str(directory), load_kwargs=load_kwargs)
        return model_snapshot(model), optimizer_snapshot(opt), opt.param_groups[0]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _state_with(tmp_path, *, lr, extra_group_entry=None):
    """A checkpoint saved by the plugin after one step of AdamW with ``lr`` (and ``extra_group_entry`` in its group)."""
    from accelerate.state import AcceleratorState, GradientState

    from accelerate_memsafe import Accelerator
    from accelerate_memsafe.models import build_llama

    acc = Accelerator(plugins=[MemSafePlugin(progress=False)], cpu=True)
    model = build_llama("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if extra_group_entry:
        opt.param_groups[0].update(extra_group_entry)
    model, opt = acc.prepare(model, opt)
    _train_step(acc, model, opt, 0)
    acc.save_state(str(tmp_path / "saved"))
    acc.wait_for_everyone()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return tmp_path / "saved"


def _stock():
    import accelerate

    return accelerate.Accelerator(cpu=True)


def _plugin():
    from accelerate_memsafe import Accelerator

    return Accelerator(plugins=[MemSafePlugin(progress=False)], cpu=True)


def test_a_numpy_learning_rate_resumes_as_stock_resumes_it_with_weights_only_false(tmp_path):
    # a learning rate computed with numpy is pickled as a numpy scalar, which torch's `weights_only` load refuses:
    # stock accelerate loads the optimizer only with `load_kwargs={"weights_only": False}`; the plugin reads numpy
    # scalars as data (no code runs) and loads it either way, bitwise what stock loads
    import numpy as np

    d = _state_with(tmp_path, lr=np.float64(1e-3))
    want = _resume_with(_stock, d, lr=np.float64(5e-2), load_kwargs={"weights_only": False})
    for load_kwargs in (None, {"weights_only": False}):
        got = _resume_with(_plugin, d, lr=np.float64(5e-2), load_kwargs=load_kwargs)
        assert_same(want[0], got[0], "model")
        assert_same(want[1], got[1], "optimizer")
        assert type(got[2]["lr"]) is np.float64 and got[2]["lr"] == 1e-3
    with pytest.raises(Exception, match="Weights only load failed"):  # stock without it
        _resume_with(_stock, d, lr=np.float64(5e-2))


def test_other_objects_in_the_optimizer_file_load_only_when_the_user_says_they_trust_it(tmp_path):
    # any other global (here `fractions.Fraction`, a class torch does not allow-list) is refused by default, before
    # anything is modified, and the message names the opt-in; with `load_kwargs={"weights_only": False}` the plugin
    # loads what stock loads with it, bitwise
    from fractions import Fraction

    d = _state_with(tmp_path, lr=1e-3, extra_group_entry={"ratio": Fraction(1, 3)})
    _load_refused(d, tmp_path, r"optimizer.bin was refused: .*fractions.Fraction.*load_kwargs=\{'weights_only': False\}")
    want = _resume_with(_stock, d, lr=5e-2, extra_group_entry={"ratio": Fraction(1, 2)},
                        load_kwargs={"weights_only": False})
    got = _resume_with(_plugin, d, lr=5e-2, extra_group_entry={"ratio": Fraction(1, 2)}, load_kwargs={"weights_only": False})
    assert_same(want[0], got[0], "model")
    assert_same(want[1], got[1], "optimizer")
    assert got[2]["ratio"] == Fraction(1, 3) and got[2]["lr"] == 1e-3
