"""Parity of the reference forward with transformers' Qwen2ForCausalLM, and left-padding invariance."""

import pytest
import torch
from conftest import random_model, tiny_config

from minigrpo.model.config import ModelConfig

transformers = pytest.importorskip("transformers")


def hf_twin(model):
    """transformers' Qwen2ForCausalLM holding exactly our weights (loaded by name: no rename table)."""
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**model.config.to_hf_dict("float32")))
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf.eval()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("heads", [(14, 2), (4, 2)], ids=["gqa7", "gqa2"])
def test_logits_match_transformers(tied, heads):
    # std 0.2 (not HF's 0.02) so that attention and MLP move the logits: with tiny weights a random model
    # mostly echoes its embedding and a broken layer could hide behind it.
    model = random_model(tiny_config(*heads, tied=tied), seed=1, std=0.2)
    hf = hf_twin(model)
    ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
    assert (ours - ref).abs().max().item() <= 1e-4
    assert ref.std() > 0.5  # the comparison is not between near-constant logits


def test_left_padding_matches_each_sequence_alone():
    model = random_model(tiny_config(), seed=2, std=0.2)
    g = torch.Generator().manual_seed(1)
    lengths = [5, 12, 9]
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    T = max(lengths)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):], mask[i, T - len(s):] = s, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        for i, s in enumerate(seqs):
            alone = model(s[None])[0]
            assert (batched[i, T - len(s):] - alone).abs().max().item() <= 1e-4
        assert torch.isfinite(batched).all()  # padding rows stay finite


def test_left_padding_matches_transformers_padded():
    model = random_model(tiny_config(tied=False), seed=3, std=0.2)
    hf = hf_twin(model)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
        ref = hf(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    real = mask.bool()
    assert (ours[real] - ref[real]).abs().max().item() <= 1e-4


def test_config_reads_the_real_qwen_config():
    from conftest import QWEN_DIR
    if not QWEN_DIR.exists():
        pytest.skip(f"{QWEN_DIR} not present")
    cfg = ModelConfig.from_json(QWEN_DIR / "config.json")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads) == (896, 24, 64, 2)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1e6


@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling .* is not supported"),
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"rope_scaling": "linear"}, "rope_scaling 'linear' is not supported"),
    ({"rope_theta": "x"}, "rope_theta must be a positive number"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
    ({"max_position_embeddings": "4k"}, "max_position_embeddings must be a positive integer"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"eos_token_id": "x"}, "eos_token_id must be token ids"),
])
def test_unsupported_config_is_a_clear_error(tmp_path, change, message):
    d = tiny_config().to_hf_dict()
    d.update(change)
    (tmp_path / "config.json").write_text(__import__("json").dumps(d))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_json(tmp_path)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff"}')  # not UTF-8: the message names the file
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        ModelConfig.from_json(tmp_path)


def test_activation_checkpointing_same_gradients_fewer_saved_activations():
    model = random_model(tiny_config(layers=3), seed=4, std=0.2)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    grads, saved = {}, {}
    for ckpt in (0, 1, 3):  # layers recomputed
        model.zero_grad(set_to_none=True)
        nbytes = []

        def pack(t):  # every tensor autograd keeps for backward (checkpointing keeps only layer inputs)
            nbytes.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = model.hidden_states(ids, mask, recompute_layers=ckpt)
        (h.float() ** 2).mean().backward()
        grads[ckpt] = {n: p.grad.clone() for n, p in model.named_parameters()}
        saved[ckpt] = sum(nbytes)
    for n, g in grads[0].items():
        for ckpt in (1, 3):
            torch.testing.assert_close(grads[ckpt][n], g, rtol=0, atol=0, msg=n)
    assert saved[3] < saved[0] / 3, saved  # measured: about 1/14 here
    # one layer of three recomputed keeps a third less, less its input; as many bytes per layer as the others
    per_layer = (saved[0] - saved[3]) / 3
    assert saved[1] == pytest.approx(saved[0] - per_layer, rel=0.02), saved
