"""Round trips between this project's checkpoints and transformers', and the errors for broken directories."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import QWEN_DIR, random_model, tiny_config
from safetensors.torch import load_file, save_file

from minigrpo.model.checkpoint import load_model, save_model

transformers = pytest.importorskip("transformers")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tied", [True, False])
def test_saved_checkpoint_loads_in_transformers_with_same_logits(tmp_path, tied):
    model = random_model(tiny_config(tied=tied), seed=4, std=0.2)
    save_model(model, tmp_path / "ckpt", tokenizer_dir=QWEN_DIR if QWEN_DIR.exists() else None)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "model.safetensors" in files and "config.json" in files and "generation_config.json" in files
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (model(IDS) - hf(IDS).logits).abs().max().item() <= 1e-4
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not tied)  # tied weights are stored once


@pytest.mark.parametrize("shard", [False, True])
def test_transformers_checkpoint_loads_here_with_same_logits(tmp_path, shard):
    hf_cfg = transformers.Qwen2Config(**tiny_config(tied=False).to_hf_dict("float32"))
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    model = load_model(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert (model(IDS) - hf(IDS).logits).abs().max().item() <= 1e-4


def test_load_assigns_dtype_and_keeps_tie(tmp_path):
    save_model(random_model(tiny_config(tied=True)), tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_save_replaces_an_existing_checkpoint_atomically(tmp_path):
    first, second = random_model(tiny_config(), seed=1), random_model(tiny_config(), seed=2)
    save_model(first, tmp_path / "ckpt")
    save_model(second, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or old directory left
    assert torch.equal(load_model(tmp_path / "ckpt", torch.float32).model.norm.weight, second.model.norm.weight)
    # as readable as config.json: safetensors alone writes 0600, hiding the weights from a shared folder's other users
    mode = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ckpt").iterdir()}
    assert mode["model.safetensors"] == mode["config.json"]



@pytest.mark.parametrize("tied", [True, False])
def test_a_policy_sharing_the_engines_memory_saves_and_loads_hf_named_tensors(tmp_path, tied):
    # Shared with the engine, the policy's parameters are views of its fused buffers (engine/decode.py):
    # saved, they must still be HF-named tensors with their own values (safetensors takes views that do not
    # overlap); loaded, they must land in the shared memory, where the engine reads them.
    from minigrpo.engine.config import EngineConfig
    from minigrpo.engine.engine import Engine

    cfg = tiny_config(tied=tied)
    model = random_model(cfg, seed=4, std=0.2)
    engine = Engine(cfg, EngineConfig(max_batch=8, max_seq_len=32), device="cpu", dtype=torch.float32)
    engine.load_weights(model)
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == engine.model.layers[0].w_qkv.data_ptr()  # shared
    save_model(model, tmp_path / "ckpt")
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    names = {k for k in random_model(cfg).state_dict() if not (tied and k == "lm_head.weight")}
    assert stored.keys() == names
    assert all(torch.equal(stored[k], v) for k, v in model.state_dict().items() if k in names)

    other = random_model(cfg, seed=5, std=0.2)
    model.load_state_dict(other.state_dict())  # how a resume loads a checkpoint (run/checkpoints.py)
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == engine.model.layers[0].w_qkv.data_ptr()
    assert torch.equal(engine.model.layers[1].w_gate_up[cfg.intermediate_size:],
                       other.model.layers[1].mlp.up_proj.weight)

# --- bad input: each error names the problem ---------------------------------------------------------------

@pytest.fixture
def ckpt(tmp_path):
    save_model(random_model(tiny_config(tied=False)), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_missing_directory_and_missing_weights(tmp_path, ckpt):
    with pytest.raises(FileNotFoundError, match="does not exist.*weights/download.py"):
        load_model(tmp_path / "nope")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="expected model.safetensors or model.safetensors.index.json"):
        load_model(ckpt)


def test_truncated_file(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model.safetensors is truncated or corrupt"):
        load_model(ckpt, torch.float32)


def test_garbage_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_model(ckpt, torch.float32)


def test_missing_and_unexpected_tensors_are_listed(ckpt):
    state = load_file(ckpt / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\) \['model.layers.1.mlp.up_proj.weight'\], "
                                         r"unexpected 1 tensor\(s\) \['model.layers.9.mlp.up_proj.weight'\]"):
        load_model(ckpt, torch.float32)


def test_shape_mismatch_names_tensor_and_shapes(ckpt):
    state = load_file(ckpt / "model.safetensors")
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.norm.weight: expected \(112,\), found \(7,\)"):
        load_model(ckpt, torch.float32)


@pytest.mark.parametrize("weight_map", [5, ["model.safetensors"], {"model.norm.weight": 3}])
def test_index_whose_weight_map_is_no_map_of_file_names(ckpt, weight_map):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="'weight_map' must map tensor names to file names"):
        load_model(ckpt, torch.float32)


def test_missing_shard(tmp_path):
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**tiny_config().to_hf_dict())).save_pretrained(
        tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shard\\(s\\) that are not there.*{victim}"):
        load_model(tmp_path)


# --- the weights script -------------------------------------------------------------------------------------

def run_script(*args, env=None):
    return subprocess.run([sys.executable, os.path.join(REPO, "weights", "download.py"), *args],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
                          timeout=120)


def test_random_init_writes_a_loadable_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    r = run_script("--random-init", "--config", str(tmp_path / "config.json"), "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    model = load_model(tmp_path / "m", torch.float32)
    assert model.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_random_init_needs_an_out_and_offline_a_config(tmp_path):
    r = run_script("--random-init")
    assert r.returncode == 2 and "--random-init needs --out DIR" in r.stderr
    r = run_script("--random-init", "--out", str(tmp_path / "m"), env={"HF_HUB_OFFLINE": "1",
                                                                       "HF_HOME": str(tmp_path / "hf")})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "cannot reach the Hugging Face Hub" in r.stderr and "--random-init --config CONFIG" in r.stderr


def test_download_offline_says_what_to_do(tmp_path):
    r = run_script("--out", str(tmp_path / "m"), env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert r.returncode != 0
    assert "cannot reach the Hugging Face Hub" in r.stderr and "--random-init" in r.stderr
    assert "Traceback" not in r.stderr
