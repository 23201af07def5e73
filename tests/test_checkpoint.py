import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.builder.model import HiggsLM
from higgs_trt.builder.tiny import write_random_checkpoint
from higgs_trt.runtime.config import HIGGS_V3, lm_tensor_shapes, parse_config
from higgs_trt.runtime.errors import HiggsError
from higgs_trt.runtime.gpu.codec import CodecDecoder


def raw_config(ckpt):
    return json.loads((ckpt / "config.json").read_text())


def test_config_reads_the_real_keys(tiny_ckpt):
    cfg = Checkpoint(tiny_ckpt).config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 2, 4, 2, 16)
    assert cfg.rope_theta == 1e6 and cfg.audio_table_rows == 8 * 1026


@pytest.mark.parametrize("edit, theta", [
    (lambda t: (t.pop("rope_parameters"), t.update(rope_theta=None)), 1e6),  # null → default
    (lambda t: (t.pop("rope_parameters"), t.pop("rope_theta")), 1e6),  # absent → default
    (lambda t: (t.pop("rope_parameters"), t.update(rope_theta=5e5)), 5e5),
    (lambda t: t.update(rope_parameters={"rope_theta": 2e6, "rope_type": "default"}), 2e6),
])
def test_rope_theta(tiny_ckpt, edit, theta):
    raw = raw_config(tiny_ckpt)
    edit(raw["text_config"])
    assert parse_config(raw).rope_theta == theta


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(model_type="llama"), "model_type"),
    (lambda c: c.pop("audio_encoder_config"), "missing audio_encoder_config"),
    (lambda c: c["audio_encoder_config"].update(use_delay_pattern=False), "use_delay_pattern"),
    (lambda c: c["audio_encoder_config"].update(num_codebooks=4), "num_codebooks"),
    (lambda c: c["audio_encoder_config"].update(vocab_size=1024), r"1024 codes \+ BOC \+ EOC"),
    (lambda c: c["text_config"].update(num_key_value_heads=3), "multiple"),
    (lambda c: c["text_config"].pop("hidden_size"), "hidden_size"),
    (lambda c: c["text_config"].update(rope_parameters={"rope_type": "yarn", "factor": 4}), "rope type"),
])
def test_config_refuses_what_the_model_cannot_be(tiny_ckpt, edit, message):
    raw = raw_config(tiny_ckpt)
    edit(raw)
    with pytest.raises(HiggsError, match=message):
        parse_config(raw)


def test_single_file_and_sharded_checkpoints_load_the_same(tiny_ckpt, tmp_path):
    single = Checkpoint(write_random_checkpoint(tmp_path / "single", seed=0, shards=1))
    sharded = Checkpoint(tiny_ckpt)
    assert single.files != sharded.files and single.names() == sharded.names()
    a = HiggsLM.from_checkpoint(single, 16).state_dict()
    b = HiggsLM.from_checkpoint(sharded, 16).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("cfg", ["tiny", HIGGS_V3], ids=["tiny", "real"])
def test_the_reference_model_reads_exactly_the_tensors_the_engines_load(tiny_ckpt, cfg):
    cfg = Checkpoint(tiny_ckpt).config if cfg == "tiny" else cfg
    with torch.device("meta"):
        model = HiggsLM(cfg, max_seq=1)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == lm_tensor_shapes(cfg)


def test_unused_tensors_are_ignored(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    model_names = set(lm_tensor_shapes(ckpt.config))
    codec_names = {"tied.embedding.modality_embeddings.0.model." + n for n in CodecDecoder.from_checkpoint(ckpt).state_dict()}
    unused = set(ckpt.names()) - model_names - codec_names
    assert "tied.head.text_head.weight" in unused
    assert any("acoustic_encoder" in n for n in unused) and any("semantic_model" in n for n in unused)
    assert any("project_in" in n for n in unused)


def test_weights_are_memory_mapped_not_copied(tiny_ckpt):
    model = HiggsLM.from_checkpoint(Checkpoint(tiny_ckpt), 16)
    table = model.audio_table
    again = HiggsLM.from_checkpoint(Checkpoint(tiny_ckpt), 16).audio_table
    assert table.dtype == torch.bfloat16 and torch.equal(table, again)
    assert not table.untyped_storage().resizable()  # backed by the file mapping, not an allocation of ours


def rewrite_shard(ckpt_dir, edit):
    index = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())
    file = ckpt_dir / index["weight_map"]["body.layers.1.mlp.up_proj.weight"]
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_and_misshaped_tensors_are_named_in_one_error(tiny_copy):
    def edit(t):
        t.pop("body.layers.1.mlp.up_proj.weight")
        name = next(n for n in t if n.endswith("q_norm.weight"))
        t[name] = torch.zeros(3, dtype=torch.bfloat16)
    rewrite_shard(tiny_copy, edit)
    with pytest.raises(HiggsError) as e:
        HiggsLM.from_checkpoint(Checkpoint(tiny_copy), 16)
    msg = str(e.value)
    assert "body.layers.1.mlp.up_proj.weight" in msg and "q_norm.weight is [3], expected [16]" in msg
    assert "\n" not in msg


def test_missing_codec_and_truncated_files(tiny_copy):
    (tiny_copy / "model.safetensors.index.json").unlink()
    with pytest.raises(HiggsError, match="neither model.safetensors nor"):
        Checkpoint(tiny_copy)
    shard = next(tiny_copy.glob("*.safetensors"))
    (tiny_copy / "model.safetensors").write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(HiggsError, match="model.safetensors"):
        Checkpoint(tiny_copy)


def test_codec_without_decoder_is_refused(tiny_copy, tmp_path):
    single = write_random_checkpoint(tmp_path / "s", shards=1)
    tensors = load_file(single / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if "acoustic_decoder" not in n}, single / "model.safetensors")
    with pytest.raises(HiggsError, match="no codec decoder"):
        CodecDecoder.from_checkpoint(Checkpoint(single))


def test_fingerprint_is_stable_and_tells_checkpoints_apart(tiny_ckpt, tmp_path):
    a = Checkpoint(tiny_ckpt).fingerprint()
    assert a == Checkpoint(write_random_checkpoint(tmp_path / "same", seed=0)).fingerprint()
    assert a != Checkpoint(write_random_checkpoint(tmp_path / "other", seed=1)).fingerprint()
    shutil.copytree(tiny_ckpt, tmp_path / "cfg")
    raw = raw_config(tmp_path / "cfg")
    raw["text_config"]["rms_norm_eps"] = 1e-5
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(raw))
    assert a != Checkpoint(tmp_path / "cfg").fingerprint()


def test_tiny_checkpoint_is_deterministic(tiny_ckpt, tmp_path):
    again = write_random_checkpoint(tmp_path / "again", seed=0)
    for f in sorted(p.name for p in tiny_ckpt.iterdir()):
        assert (tiny_ckpt / f).read_bytes() == (again / f).read_bytes(), f


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_named_in_every_float_dtype(tiny_copy, dtype, value):
    name = "body.layers.1.mlp.up_proj.weight"

    def edit(t):
        x = t[name].to(dtype)
        x.view(-1)[-1] = value  # the last element: the chunked reader must reach the end of the tensor
        t[name] = x
    rewrite_shard(tiny_copy, edit)
    ckpt = Checkpoint(tiny_copy)
    with pytest.raises(HiggsError, match=f"tensor {name} holds inf or NaN values"):
        HiggsLM.from_checkpoint(ckpt, 16)
    ckpt.check_finite([n for n in ckpt.names() if n != name and ckpt.dtype(n) == "BF16"])  # the mapping was released


def test_largest_finite_values_pass(tiny_copy):
    name = "body.layers.1.mlp.up_proj.weight"

    def edit(t):
        x = t[name].clone()
        x.view(-1)[:2] = torch.tensor([torch.finfo(torch.bfloat16).max, -torch.finfo(torch.bfloat16).max])
        t[name] = x
    rewrite_shard(tiny_copy, edit)
    HiggsLM.from_checkpoint(Checkpoint(tiny_copy), 16)
