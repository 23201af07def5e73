"""The GPU engine's codec calls: streaming windows decoded as CUDA graphs on a stream of their own, beside the decode
steps, their audio collected by the scheduler when it is ready."""

import time

import numpy as np
import torch

from higgs_trt.runtime.slots import Decoded
from higgs_trt.runtime.streaming import StreamPlan

from .launches import CODEC_BUCKETS, bucket_table


class CodecGraphs:
    """One codec decoder on one device: captured window shapes (per window count of CODEC_BUCKETS), eager otherwise;
    a call of more windows than the largest count, in pieces of that many."""

    def __init__(self, codec, max_batch: int, device: torch.device):
        self.model, self.device = codec, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.buckets, self.bucket_of = bucket_table(CODEC_BUCKETS, min(max_batch, CODEC_BUCKETS[-1]))
        self.graphs: dict = {}  # (windows, (frames, keep)) → (graph, its codes input, its kept waveform)
        self.pool = None  # the graphs' memory pool, shared: they run one after another on one stream
        self.seconds: list[float] = []  # host time of the last calls (benchmarks read these)
        self.waited = 0.0  # seconds the host spent waiting for a call's audio

    @torch.inference_mode()
    def prepare(self, plan: StreamPlan) -> None:
        """The codec windows of `plan` (StreamPlan.window_shapes: the first ones', the middle ones' and the last one's
        widest) as CUDA graphs, one per window count of CODEC_BUCKETS (a call of fewer windows pads up to the next),
        for shapes not captured yet. Eager windows are ~100 small kernels each; issued from the scheduler's thread they
        keep it from launching decode steps while the GPU idles."""
        if self.stream is None:
            return
        shapes = set(plan.window_shapes()) - {shape for _, shape in self.graphs}
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(self.stream):
            for frames, keep in sorted(shapes):
                for n in self.buckets:
                    codes = torch.zeros(n, self.model.dims.num_quantizers, frames, dtype=torch.int64, device=self.device)
                    self.model(codes, keep)  # warm-up outside capture (cuDNN picks its algorithms)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=self.stream, pool=self.pool):
                        wave = self.model(codes, keep)
                    self.graphs[n, (frames, keep)] = (graph, codes, wave)

    def captured(self, windows: int, frames: int, keep: tuple[int, int]):
        """(graph, codes, wave, the kept frames) of the captured call for this many windows of `frames` that keeps the
        fewest frames covering `keep` (a last window's replays the widest one's), or None."""
        bucket = self.bucket_of[windows] if windows < len(self.bucket_of) else None
        found = [(b - a, (a, b)) for n, (f, (a, b)) in self.graphs
                 if n == bucket and f == frames and a <= keep[0] and keep[1] <= b]
        if not found:
            return None
        kept = min(found)[1]
        return (*self.graphs[bucket, (frames, kept)], kept)

    @torch.inference_mode()
    def __call__(self, codes: np.ndarray, keep: tuple[int, int] | None = None) -> "PendingAudio | Decoded | Pieces":
        """Windows of equal length decoded on the codec stream; only the samples that frames `keep` depend on are
        computed (CodecDecoder's keep)."""
        most = self.buckets[-1]
        if codes.shape[0] > most:
            return Pieces([self(codes[i:i + most], keep) for i in range(0, codes.shape[0], most)])
        t0 = time.perf_counter()
        windows, frames = codes.shape[0], codes.shape[-1]
        keep = keep or (0, frames)
        if self.stream is None:
            audio = Decoded(self.model(torch.from_numpy(codes), keep).numpy())
        else:
            # pinned, so that neither copy waits for the codec stream's earlier calls
            codes = torch.from_numpy(codes).pin_memory()
            with torch.cuda.stream(self.stream):
                captured = self.captured(windows, frames, keep)
                if captured is not None:
                    graph, inputs, wave, kept = captured
                    inputs[:windows].copy_(codes, non_blocking=True)
                    inputs[windows:].zero_()  # padding windows: their audio is not read
                    graph.replay()
                    hop = self.model.dims.hop
                    wave = wave[:windows, :, (keep[0] - kept[0]) * hop:(keep[1] - kept[0]) * hop]
                else:
                    wave = self.model(codes.to(self.device, non_blocking=True), keep)
                host = torch.empty(wave.shape, dtype=wave.dtype, pin_memory=True)
                host.copy_(wave, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            audio = PendingAudio(self, done, host)
        self.seconds.append(time.perf_counter() - t0)
        del self.seconds[:-64]
        return audio


class PendingAudio:
    """A codec call in flight on the GPU: ready() without waiting, result() waits (counted in CodecGraphs.waited)."""

    def __init__(self, calls: CodecGraphs, done: "torch.cuda.Event", host: torch.Tensor):
        self.calls, self.done, self.host = calls, done, host

    def ready(self) -> bool:
        return self.done.query()

    def result(self) -> np.ndarray:
        t0 = time.perf_counter()
        self.done.synchronize()
        self.calls.waited += time.perf_counter() - t0
        return self.host.numpy()


class Pieces:
    """A codec call made in pieces: ready once every piece is, their audio one after another."""

    def __init__(self, pieces: list):
        self.pieces = pieces

    def ready(self) -> bool:
        return all(piece.ready() for piece in self.pieces)

    def result(self) -> np.ndarray:
        return np.concatenate([piece.result() for piece in self.pieces])
