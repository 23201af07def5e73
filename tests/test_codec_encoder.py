"""Voice cloning from reference audio: the codec encoder against transformers' HiggsAudioV2TokenizerModel.encode,
ONNX Runtime against torch, the 24 → 16 kHz resampler against torchaudio's, the audio reader's checks, the CLI, the
cache."""

import math
import wave

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hf_codec import hf_codec_class, torchaudio_kernel, torchaudio_resample

from higgs_trt.builder.checkpoint import Checkpoint
from higgs_trt.builder.codec_encoder import PREFIX, CodecEncoder
from higgs_trt.runtime import audio
from higgs_trt.runtime.bench.encode import FILE_RATE, synthetic_voice
from higgs_trt.runtime.cli import main
from higgs_trt.runtime.manifest import EngineDir
from higgs_trt.runtime.resample import resample, sinc_kernel

transformers = pytest.importorskip("transformers")
julius = pytest.importorskip("julius")
soundfile = pytest.importorskip("soundfile")


class Resampler:
    """Stands in for `torchaudio.functional.resample`, the one torchaudio call in transformers' encode (its
    24 → 16 kHz step): torchaudio's wheels do not load beside a CPU torch. It hands back the 16 kHz signal a test
    gives, or else resamples with torchaudio's own algorithm transcribed in torch (hf_codec.torchaudio_resample)."""

    given: torch.Tensor | None = None

    def __call__(self, waveform, orig_freq, new_freq):
        if self.given is not None:
            return self.given
        return torchaudio_resample(waveform, orig_freq, new_freq)


RESAMPLE = Resampler()


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return Checkpoint(tiny_ckpt)


@pytest.fixture(scope="module")
def ours(ckpt):
    return CodecEncoder.from_checkpoint(ckpt)


@pytest.fixture(scope="module")
def oracle(ckpt, ours):
    d = ours.dims
    cfg = transformers.HiggsAudioV2TokenizerConfig(
        acoustic_model_config={"encoder_hidden_size": d.acoustic_channels[0], "downsampling_ratios": list(d.acoustic_strides),
                               "upsampling_ratios": list(d.acoustic_strides), "hidden_size": d.acoustic_dim,
                               "decoder_hidden_size": 64},
        semantic_model_config={"hidden_size": d.semantic_dim, "num_hidden_layers": d.num_layers,
                               "num_attention_heads": d.num_heads, "intermediate_size": d.intermediate,
                               "conv_dim": list(d.conv_dim), "num_conv_pos_embeddings": d.pos_kernel,
                               "num_conv_pos_embedding_groups": d.pos_groups},
        codebook_dim=d.codebook_dim, codebook_size=d.codebook_size, target_bandwidths=[0.5, 1, 1.5, 2])
    model = hf_codec_class(RESAMPLE)(cfg).eval()
    encode_side = [k for k in model.state_dict() if not k.startswith(("acoustic_decoder.", "decoder_semantic.", "fc1.", "fc2."))]
    missing = [k for k in encode_side if PREFIX + k not in ckpt]
    assert not missing, missing  # every tensor the oracle's encoder has, under the checkpoint's own names
    model.load_state_dict({k: ckpt.tensor(PREFIX + k).float() for k in encode_side}, strict=False)
    return model


def oracle_encode(oracle, audio_24k: torch.Tensor, audio_16k: torch.Tensor | None) -> torch.Tensor:
    RESAMPLE.given = audio_16k
    try:
        with torch.no_grad():
            return oracle.encode(audio_24k, return_dict=False)
    finally:
        RESAMPLE.given = None


def clip(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    t = torch.arange(n) / audio.SAMPLE_RATE
    if kind == "noise":
        return (0.3 * torch.randn(n, generator=g))[None, None]
    return (0.5 * torch.sin(2 * math.pi * (100 * t + 2000 * t ** 2)))[None, None]  # 100 Hz → ~12 kHz chirp


def semantic(audio_24k: torch.Tensor) -> torch.Tensor:
    """The runtime's 16 kHz branch of a [1, 1, N] signal."""
    return torch.from_numpy(resample(audio_24k[0, 0].numpy(), audio.SAMPLE_RATE, audio.SEMANTIC_RATE))[None, None]


@pytest.mark.parametrize("kind, n", [("noise", 48000), ("chirp", 72000), ("noise", 48000 + 517)])
def test_codes_equal_transformers_encode_given_the_same_signals(ours, oracle, kind, n):
    audio_24k = clip(kind, n)
    audio_16k = semantic(audio_24k)
    assert audio_16k.shape[-1] == math.ceil(n * 2 / 3)
    pad = audio.acoustic_padding(n, audio_16k.shape[-1], ours.dims.geometry())
    assert pad == (0 if n % 960 == 0 else 480)  # both paths of transformers' padding rule are taken
    want = oracle_encode(oracle, audio_24k, audio_16k)
    got = ours.encode(audio_24k, audio_16k)
    assert got.shape == want.shape == (1, 8, math.ceil(n / 960))
    assert torch.equal(got.long(), want)
    assert len(torch.unique(want)) > 200  # codes that tell encoders apart, not a constant


@pytest.mark.parametrize("kind, n", [("noise", 48000 + 517), ("chirp", 72000), ("voice", 240000)])
def test_a_24k_file_gives_the_codes_of_transformers_encode(tiny_engine, oracle, tmp_path, kind, n):
    """Equal 24 kHz signals, equal codes: the runtime's whole path (soundfile, checks, the 16 kHz branch derived
    with torchaudio's filter in numpy, padding rule, codec_encoder.onnx in ONNX Runtime) against transformers' encode
    doing its own 24 → 16 kHz step, broadband clips included."""
    from higgs_trt.runtime.backends.ort import OrtEncoder

    signal = synthetic_voice(n / 24000, rate=24000)[:, 0] if kind == "voice" else clip(kind, n)[0, 0].numpy()
    ref = audio.load_reference_audio(write(tmp_path / "ref.wav", signal, rate=24000, subtype="FLOAT"))
    assert np.array_equal(ref.audio_24k, signal)
    got = audio.encode_reference(ref, OrtEncoder(EngineDir(tiny_engine)))
    want = oracle_encode(oracle, torch.from_numpy(signal)[None, None], None)
    assert np.array_equal(got.T[None], want.numpy())


def test_end_to_end_from_a_44k_stereo_file(tiny_engine, oracle, tmp_path):
    """The runtime's path (soundfile, channel mean, soxr to 24 kHz, torchaudio's filter to 16 kHz, padding rule,
    codec_encoder.onnx in ONNX Runtime) against the reference pipeline (stdlib wave, channel mean, torchaudio's
    resampling to 24 kHz, transformers' encode resampling to 16 kHz itself). The codes differ only where the two
    24 kHz signals do: soxr is flat to 0.9 Nyquist, torchaudio's 6-zero filter droops from about 0.5 Nyquist."""
    from higgs_trt.runtime.backends.ort import OrtEncoder

    encoder = OrtEncoder(EngineDir(tiny_engine))
    same = total = 0
    for seed in range(4):
        path = tmp_path / f"voice{seed}.wav"
        soundfile.write(path, synthetic_voice(10.0, seed=seed), FILE_RATE, subtype="PCM_16")
        got = torch.from_numpy(audio.encode_reference(audio.load_reference_audio(path), encoder).T[None].copy())
        with wave.open(str(path)) as w:
            assert (w.getnchannels(), w.getframerate()) == (2, FILE_RATE)
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2").reshape(-1, 2) / 32768.0
        mono = torch.from_numpy(pcm.astype(np.float32).mean(axis=1, dtype=np.float32))[None, None]
        want = oracle_encode(oracle, torchaudio_resample(mono, FILE_RATE, 24000), None)
        assert got.shape == want.shape
        equal = got.long() == want
        same, total = same + int(equal.sum()), total + equal.numel()
        print(f"clip {seed}: {equal.float().mean():.4f} of codes identical; per codebook "
              f"{[round(float(x), 3) for x in equal.float().mean(dim=(0, 2))]}; frames that differ "
              f"{torch.nonzero(~equal[0].all(0)).flatten().tolist()}")
    print(f"44.1 kHz stereo → codes: {same}/{total} = {same / total:.4f} identical to the reference pipeline")
    assert same / total >= 0.99


def test_padding_rule_gives_matching_frames_over_the_whole_range(ours):
    geometry = ours.dims.geometry()
    for n in range(24000, 720001, 7):
        m = math.ceil(n * 2 / 3)
        pad = audio.acoustic_padding(n, m, geometry)
        acoustic, semantic = audio.branch_frames(n + 2 * pad, m, geometry)
        assert acoustic == semantic


def test_onnx_runtime_equals_torch(tiny_engine, ours):
    from higgs_trt.runtime.backends.ort import OrtEncoder

    io = EngineDir(tiny_engine).graph("codec_encoder")
    assert [(t["name"], t["shape"], t["dtype"]) for t in io["inputs"] + io["outputs"]] == [
        ("audio_24k", [1, 1, "samples_24k"], "float32"), ("audio_16k", [1, 1, "samples_16k"], "float32"),
        ("codes", [1, 8, "frames"], "int32")]
    assert io["geometry"] == ours.dims.geometry()
    encoder = OrtEncoder(EngineDir(tiny_engine))
    for n in (24000, 48000 + 517, 240000):
        signal = clip("noise", n)[0, 0].numpy()
        ref = audio.ReferenceAudio(signal, semantic(clip("noise", n))[0, 0].numpy(), "", n / 24000, 24000)
        inputs = audio.encoder_inputs(ref, encoder.geometry)
        got = encoder.encode(*inputs)
        want = ours(*(torch.from_numpy(x) for x in inputs)).numpy()
        assert got.dtype == np.int32 and got.shape == want.shape == (1, 8, math.ceil(n / 960))
        assert np.array_equal(got, want)


# ---- the 24 → 16 kHz step: torchaudio's filter in numpy -------------------------------------------------------

@pytest.mark.parametrize("orig, new", [(3, 2), (147, 80), (2, 3), (1, 3)])
def test_the_kernel_is_torchaudios(orig, new):
    want, width = torchaudio_kernel(orig, new)
    got, got_width = sinc_kernel(orig, new)
    assert got.dtype == np.float32 and got_width == width and got.shape == want[:, 0].shape
    np.testing.assert_allclose(got, want[:, 0].numpy(), rtol=0, atol=1e-7)  # an ulp: torch's float32 sin and cos
    # julius, the same derivation written elsewhere, scales each phase to unit gain at DC instead
    theirs = julius.ResampleFrac(orig, new, zeros=6, rolloff=0.99).kernel[:, 0].numpy()
    np.testing.assert_allclose(got / got.sum(axis=1, keepdims=True), theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("orig, new", [(24000, 16000), (44100, 24000), (16000, 24000), (8000, 24000), (48000, 24000)])
def test_resample_equals_torchaudio_sample_by_sample(orig, new):
    g = torch.Generator().manual_seed(orig + new)
    for n in (orig - 1, orig, orig + 1, 3 * orig + 517):  # the output length's rounding, the padding's tail
        x = 0.5 * torch.randn(n, generator=g).clamp(-2, 2)  # broadband: the filter's edge and its aliasing matter
        want = torchaudio_resample(x[None, None], orig, new)[0, 0].numpy()
        got = resample(x.numpy(), orig, new)
        assert got.dtype == np.float32 and got.shape == want.shape == (math.ceil(n * new / orig),)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


# ---- the reader's checks and the CLI ---------------------------------------------------------------------------

def write(path, samples, rate=FILE_RATE, **kw):
    soundfile.write(path, samples, rate, **kw)
    return path


def voice(seconds=1.5, channels=2):
    return synthetic_voice(seconds)[:, :channels]


@pytest.fixture(scope="module")
def ref_wav(tmp_path_factory):
    return write(tmp_path_factory.mktemp("ref") / "ref.wav", voice(), subtype="PCM_16")


def write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


def truncated(path):
    write(path, voice(2.0), subtype="PCM_16")
    return write_bytes(path, path.read_bytes()[:30])  # the header cut inside the fmt chunk


BAD_AUDIO = [
    ("missing", lambda p: p.with_name("nothere.wav"), "not found"),
    ("corrupt", lambda p: write_bytes(p, b"RIFF\x10\x00\x00\x00WAVEfmt junk" + bytes(range(256)) * 40), "cannot read audio"),
    ("truncated", truncated, "cannot read audio"),
    ("not audio", lambda p: write_bytes(p, b"hello, I am text\n" * 400), "cannot read audio"),
    ("empty", lambda p: write(p, np.zeros((0, 1), np.float32)), "is empty"),
    ("short", lambda p: write(p, voice(0.5)), "at least 1 s"),
    ("long", lambda p: write(p, np.tile(voice(1.0), (31, 1))), "at most 30 s"),
    ("a sample short of 1 s", lambda p: write(p, voice(1.0)[1:]), "0.99 s of audio; a reference needs at least 1 s"),
    ("a sample past 30 s", lambda p: write(p, np.tile(voice(1.0), (30, 1))[np.r_[0:30 * FILE_RATE, 0]]),
     "30.1 s of audio; a reference may be at most 30 s"),
    ("silent", lambda p: write(p, np.zeros((FILE_RATE * 2, 2), np.float32)), "is silent"),
    ("a DC offset alone", lambda p: write(p, np.full((FILE_RATE * 2, 2), 0.5, np.float32)), "is silent"),
    ("nan", lambda p: write(p, np.where(np.arange(FILE_RATE * 2)[:, None] == 999, np.nan, voice(2.0)), subtype="FLOAT"),
     "NaN"),
    ("float32's top", lambda p: write(p, np.full((FILE_RATE * 2, 2), 3e38, np.float32), subtype="FLOAT"),
     "beyond ±100"),  # the channels' sum overflowed to inf: all-zero codes before
    ("3 channels", lambda p: write(p, np.concatenate([voice(2.0), voice(2.0)[:, :1]], axis=1)), "3 channels"),
    ("4 kHz", lambda p: write(p, voice(2.0)[::11], rate=4000), "sampled at 4000 Hz"),
    ("noise as mp3", lambda p: write_bytes(p.with_suffix(".mp3"), np.random.default_rng(0).bytes(50_000)),
     "corrupt, or not a format libsndfile decodes"),
]


@pytest.mark.parametrize("name, make, message", BAD_AUDIO, ids=[b[0] for b in BAD_AUDIO])
def test_bad_reference_audio_is_one_error_line_and_writes_nothing(tiny_engine, tmp_path, name, make, message):
    path = make(tmp_path / "bad.wav")
    out = tmp_path / "codes.npy"
    r = CliRunner().invoke(main, ["encode-audio", "--engine", str(tiny_engine), "--audio", str(path), "--out", str(out)])
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("Error: ") and message in lines[-1] and len([x for x in lines if "Error" in x]) == 1
    assert "Traceback" not in r.output and not out.exists() and list(tmp_path.glob("*.npy")) == []


@pytest.mark.parametrize("fmt, subtype", [("FLAC", "PCM_16"), ("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III")])
def test_compressed_formats_are_read(tmp_path, fmt, subtype):
    path = write(tmp_path / f"ref.{fmt.lower()}", voice(1.5), format=fmt, subtype=subtype)
    ref = audio.load_reference_audio(path)
    assert abs(ref.seconds - 1.5) < 0.1 and len(ref.audio_16k) == math.ceil(len(ref.audio_24k) * 2 / 3)


def test_encode_audio_writes_the_ref_codes_layout_and_torch_agrees(tiny_ckpt, tiny_engine, ref_wav, tmp_path):
    from higgs_trt.runtime.prompt import load_reference_codes

    for name, source in (("ort", ["--engine", str(tiny_engine)]), ("torch", ["--checkpoint", str(tiny_ckpt)])):
        r = CliRunner().invoke(main, ["encode-audio", *source, "--audio", str(ref_wav), "--out", str(tmp_path / f"{name}.npy")])
        assert r.exit_code == 0, r.output
    codes = load_reference_codes(tmp_path / "ort.npy")  # what --ref-codes reads
    assert codes.shape == (math.ceil(1.5 * 25), 8) and np.load(tmp_path / "ort.npy").dtype == np.int32
    assert np.array_equal(codes, load_reference_codes(tmp_path / "torch.npy"))


def test_clone_from_audio_equals_clone_from_its_codes(tiny_engine, ref_wav, tmp_path):
    runner, base = CliRunner(), ["run", "--engine", str(tiny_engine), "--text", "Hello there.", "--ref-text", "A voice."]
    r = runner.invoke(main, ["encode-audio", "--engine", str(tiny_engine), "--audio", str(ref_wav), "--out", str(tmp_path / "ref.npy")])
    assert r.exit_code == 0, r.output
    for sampling in (["--temperature", "0"], ["--temperature", "1", "--seed", "7"]):
        outs = []
        for i, ref in enumerate((["--ref-audio", str(ref_wav)], ["--ref-codes", str(tmp_path / "ref.npy")])):
            audio._cache.clear()  # encode the audio again inside `run`, not reuse encode-audio's result
            r = runner.invoke(main, [*base, *ref, *sampling, "--out", str(tmp_path / f"{i}.wav"), "--codes-out", str(tmp_path / f"{i}.npy")])
            assert r.exit_code == 0, r.output
            outs.append((np.load(tmp_path / f"{i}.npy"), (tmp_path / f"{i}.wav").read_bytes()))
        assert np.array_equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]
    r = runner.invoke(main, [*base, "--ref-audio", str(ref_wav), "--ref-codes", str(tmp_path / "ref.npy"), "--out", str(tmp_path / "x.wav")])
    assert r.exit_code == 1 and "not both" in r.stderr and not (tmp_path / "x.wav").exists()


def test_a_checkpoint_without_an_encoder_is_refused(tiny_copy, ref_wav, tmp_path):
    from safetensors.torch import load_file, save_file

    for shard in tiny_copy.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({n: t for n, t in tensors.items() if "acoustic_encoder" not in n}, shard, metadata={"format": "pt"})
    r = CliRunner().invoke(main, ["encode-audio", "--checkpoint", str(tiny_copy), "--audio", str(ref_wav), "--out", str(tmp_path / "c.npy")])
    assert r.exit_code == 1 and "carries no codec encoder tensors" in r.stderr and not (tmp_path / "c.npy").exists()


class Counting:
    """A real encoder that counts its calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.name, self.identity, self.geometry = inner.name, inner.identity, inner.geometry

    def encode(self, *inputs):
        self.calls += 1
        return self.inner.encode(*inputs)


def test_references_are_cached_by_audio_content(tiny_engine, tmp_path):
    from higgs_trt.runtime.backends.ort import OrtEncoder

    audio._cache.clear()
    encoder = Counting(OrtEncoder(EngineDir(tiny_engine)))
    samples = (voice(1.2) * 32767).astype(np.int16)  # integers: both writers store them exactly
    first = audio.encode_reference(audio.load_reference_audio(write(tmp_path / "a.wav", samples, subtype="PCM_16")), encoder)
    again = audio.encode_reference(audio.load_reference_audio(write(tmp_path / "b.flac", samples, subtype="PCM_16")), encoder)
    assert encoder.calls == 1 and np.array_equal(first, again)  # the same samples in another container: a hit
    other = audio.encode_reference(audio.load_reference_audio(write(tmp_path / "c.wav", voice(1.3), subtype="PCM_16")), encoder)
    assert encoder.calls == 2 and other.shape[0] != first.shape[0]
    audio.encode_reference(audio.load_reference_audio(tmp_path / "a.wav"), encoder)
    assert encoder.calls == 2


def test_run_with_ref_audio_without_torch(tiny_engine, ref_wav, tmp_path):
    from test_runtime_isolation import run_blocked

    out = tmp_path / "out.wav"
    r = run_blocked(f"from higgs_trt.runtime.cli import main\nmain(['run', '--engine', r'{tiny_engine}', '--text', 'Hi.', "
                    f"'--ref-audio', r'{ref_wav}', '--temperature', '0', '--out', r'{out}'])")
    assert r.returncode == 0, r.stderr
    assert "encoded 1.50 s of reference audio" in r.stderr and out.stat().st_size > 44

