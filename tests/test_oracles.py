"""Parity against implementations nobody here wrote: transformers' Qwen3 and HiggsAudioV2TokenizerModel."""

import pytest
import torch
from hf_codec import hf_codec_class

from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.builder.model import HiggsLM
from higgs_trt.runtime.gpu.codec import PREFIX, CodecDecoder

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return Checkpoint(tiny_ckpt)


def hf_qwen3(ckpt):
    cfg = ckpt.config
    hf_cfg = transformers.Qwen3Config(
        vocab_size=cfg.text_vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attention_bias=False,
    )
    hf_cfg._attn_implementation = "eager"
    model = transformers.Qwen3Model(hf_cfg).eval()
    state = {}
    for name in ckpt.names():
        if name.startswith("body."):
            state[name.removeprefix("body.")] = ckpt.tensor(name).float()
    state["embed_tokens.weight"] = ckpt.tensor("tied.embedding.text_embedding.weight").float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    # Higgs was trained with a bf16-rounded RoPE table; give the oracle the same table (the only change).
    rope = model.rotary_emb.forward
    model.rotary_emb.forward = lambda x, pos: tuple(t.bfloat16().to(x.dtype) for t in rope(x, pos))
    return model


def test_backbone_matches_transformers_qwen3_prefill_and_decode(ckpt):
    ours = HiggsLM.from_checkpoint(ckpt, max_seq=64, dtype=torch.float32)
    oracle = hf_qwen3(ckpt)
    torch.manual_seed(0)
    ids = torch.randint(0, ckpt.config.text_vocab_size, (2, 11), dtype=torch.int32)
    codes = torch.randint(0, 1026, (2, 11, 8), dtype=torch.int32)
    is_audio = torch.rand(2, 11) < 0.5
    with torch.no_grad():
        x = ours.embed(ids, codes, is_audio)
        # prefill all 11 positions at once
        h, _ = ours.backbone(x, torch.zeros(2, dtype=torch.int64), ours.new_caches(2))
        ref = oracle(inputs_embeds=x).last_hidden_state
        assert (h - ref).abs().max() < 1e-5
        # prefill 4, then decode one position at a time against the oracle's own cache
        h, caches = ours.backbone(x[:, :4], torch.zeros(2, dtype=torch.int64), ours.new_caches(2))
        out = oracle(inputs_embeds=x[:, :4], use_cache=True)
        cache, steps = out.past_key_values, [h]
        for t in range(4, 11):
            h, caches = ours.backbone(x[:, t:t + 1], torch.full((2,), t), caches)
            out = oracle(inputs_embeds=x[:, t:t + 1], cache=cache, use_cache=True,
                         position_ids=torch.full((2, 1), t))
            cache = out.past_key_values
            assert (h - out.last_hidden_state).abs().max() < 1e-5, t
            steps.append(h)
        assert (torch.cat(steps, 1) - ref).abs().max() < 1e-5


def test_codec_matches_transformers_higgs_audio_v2_tokenizer(ckpt):
    ours = CodecDecoder.from_checkpoint(ckpt)
    d = ours.dims
    assert d.num_quantizers == 8 and d.hop == 960
    cfg = transformers.HiggsAudioV2TokenizerConfig(
        # pass both ratio lists and hidden sizes: DacConfig otherwise derives them (reversed decoder strides)
        acoustic_model_config={"encoder_hidden_size": 4, "downsampling_ratios": list(d.strides),
                               "upsampling_ratios": list(d.strides), "decoder_hidden_size": d.channels[0],
                               "hidden_size": d.acoustic_dim},
        semantic_model_config={"hidden_size": d.latent_dim - d.acoustic_dim, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "intermediate_size": 32, "conv_dim": [8], "conv_stride": [5],
                               "conv_kernel": [10], "num_conv_pos_embeddings": 4, "num_conv_pos_embedding_groups": 1},
        codebook_dim=d.codebook_dim, codebook_size=d.codebook_size,
        target_bandwidths=[0.5, 1, 1.5, 2],  # hop 960: 2 kbps ↔ 8 quantizers
    )
    oracle = hf_codec_class()(cfg).eval()
    decoder_keys = [k for k in oracle.state_dict() if k.startswith(("quantizer.", "fc2.", "acoustic_decoder."))
                    and not k.endswith(("project_in.weight", "project_in.bias", "embed_avg", "cluster_size", "inited"))]
    state = {k: ckpt.tensor(PREFIX + k).float() for k in decoder_keys}
    _, unexpected = oracle.load_state_dict(state, strict=False)
    assert not unexpected and len(state) == len(dict(ours.state_dict()))
    codes = torch.randint(0, 1024, (2, 8, 13))
    with torch.no_grad():
        ref = oracle.decode(codes, return_dict=False)
        got = ours(codes.to(torch.int32))
    assert got.shape == ref.shape == (2, 1, 960 * 13)
    assert (got - ref).abs().max() < 1e-4
