"""Check every varlen attention backend against the per-segment reference, and time packed vs padded;
then probe packing isolation in every model family of docs/isolation.md on the backends here.

    .venv/bin/python bench/gpu_check.py                      # CUDA when available, else the CPU subset
    .venv/bin/python bench/gpu_check.py --isolation-only     # only the family x backend probe
    .venv/bin/python bench/gpu_check.py --time-limit 300 --json isolation.json

Isolation (`packtool.loader.probe`): each family's tiny random model runs a packed row of three documents
with packtool's inputs (`model_inputs`) on eager, sdpa and, where importable, flash_attention_2 /
flash_attention_3 (bf16); flex only for Llama on CUDA (HF compiles it per model, ~40 s). The Gated DeltaNet
and Mamba-2 layers use the flash-linear-attention / causal-conv1d / mamba-ssm kernels when those
are installed, and their torch fallbacks otherwise (which the table in docs/isolation.md says
leak or refuse). The whole script stops itself after --time-limit seconds (default 480) and
prints what it finished; each family takes a few seconds on a GPU.

On CUDA: flash_attn (if importable), torch varlen_attn, flex (eager) and SDPA with the block
mask are compared with per-segment causal SDPA on packed batches (bf16, tolerance 2e-2), forward
and backward; `chunked_token_loss_sum` is compared with the full loss (bf16, V=151,936, T=4096:
value, gradients, peak CUDA memory); then packed varlen attention is timed against padded
attention ([B, Lmax] batch, causal). On CPU only the fp32/fp64 reference paths and a small
chunked-loss check run, and the CUDA parts are reported as skipped. Finishes in well under 5 minutes on either.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from packtool.loader.attention import _flash_attn_func, _torch_varlen, per_segment_attention, varlen_attention
from packtool.loader.loss import chunked_token_loss_sum, token_loss_sum


def packed_lengths(capacity: int, seed: int) -> list[int]:
    """SFT-like lengths (many short, some long) greedily filling one pack of `capacity`."""
    g = torch.Generator().manual_seed(seed)
    lengths, used = [], 0
    while used < capacity:
        n = int(torch.randint(16, capacity // 4, (1,), generator=g))
        n = min(n, capacity - used)
        lengths.append(n)
        used += n
    return lengths


def make_qkv(lengths, heads, dim, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=g).to(device, dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu, max(lengths)


def compare(backends, lengths, heads, dim, dtype, device, atol) -> list[str]:
    q, k, v, cu, max_len = make_qkv(lengths, heads, dim, dtype, device)
    ref = per_segment_attention(q.double(), k.double(), v.double(), cu)
    failures = []
    for name in backends:
        try:
            out = varlen_attention(q, k, v, cu, max_len, backend=name)
        except Exception as err:  # report every backend, do not stop at the first broken one
            print(f"  {name:13s} ERROR {type(err).__name__}: {err}")
            failures.append(name)
            continue
        diff = (out.double() - ref).abs().max().item()
        ok = diff <= atol
        print(f"  {name:13s} max|diff| {diff:.2e}  {'ok' if ok else 'FAIL'} (atol {atol:g})")
        if not ok:
            failures.append(name)
    return failures


def compare_backward(backends, lengths, heads, dim, dtype, device, atol) -> list[str]:
    failures = []
    q, k, v, cu, max_len = make_qkv(lengths, heads, dim, dtype, device, seed=1)
    grad_out = torch.randn_like(q)
    leaves = [x.detach().double().clone().requires_grad_() for x in (q, k, v)]
    (per_segment_attention(*leaves, cu) * grad_out.double()).sum().backward()
    ref = [x.grad for x in leaves]
    for name in backends:
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        try:
            (varlen_attention(*xs, cu, max_len, backend=name) * grad_out).sum().backward()
        except Exception as err:
            print(f"  {name:13s} backward ERROR {type(err).__name__}: {err}")
            failures.append(name)
            continue
        diff = max((x.grad.double() - r).abs().max().item() for x, r in zip(xs, ref, strict=True))
        ok = diff <= atol
        print(f"  {name:13s} backward max|diff| {diff:.2e}  {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(name)
    return failures


def time_it(fn, device, repeats=20) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def packed_vs_padded(backend, lengths_per_row, heads, dim, dtype, device) -> None:
    lengths = [n for row in lengths_per_row for n in row]
    q, k, v, cu, max_len = make_qkv(lengths, heads, dim, dtype, device)
    packed_ms = time_it(lambda: varlen_attention(q, k, v, cu, max_len, backend=backend), device)
    batch = len(lengths)  # padded: one sample per row, padded to the longest
    pq, pk, pv = (torch.randn(batch, heads, max_len, dim, device=device, dtype=dtype) for _ in range(3))
    padded_ms = time_it(lambda: F.scaled_dot_product_attention(pq, pk, pv, is_causal=True), device)
    useful = sum(lengths) / (batch * max_len)
    print(
        f"  {backend}: packed {packed_ms:.2f} ms ({sum(lengths)} tokens) vs padded SDPA {padded_ms:.2f} ms "
        f"({batch}x{max_len}, {useful:.0%} real tokens)"
    )


def chunked_loss_check(vocab: int = 151_936, tokens: int = 4096, hidden: int = 1024, device: str = "cuda") -> list[str]:
    """bf16 hidden states and weight: chunked vs full loss, value, gradients and (CUDA) peak memory."""
    cuda = device == "cuda"
    g = torch.Generator(device="cpu").manual_seed(0)
    h0 = torch.randn(1, tokens, hidden, generator=g).to(device, torch.bfloat16)
    w0 = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, torch.bfloat16)
    labels = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    labels[0, ::7] = -100
    results = {}
    for name, fn in (("full", lambda h, w: token_loss_sum(h @ w.T, labels)), ("chunked", None)):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        loss, n = fn(h, w) if fn else chunked_token_loss_sum(h, w, labels)
        (loss / n).backward()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
        results[name] = (loss.item() / n, h.grad.float(), w.grad.float())
        print(
            f"  {name:8s} loss {results[name][0]:.5f}  peak +{peak:.0f} MiB  (V={vocab:,}, T={tokens}, bf16, {device})"
        )
    diff = max((a - b).abs().max().item() for a, b in zip(results["full"][1:], results["chunked"][1:], strict=True))
    ok = abs(results["full"][0] - results["chunked"][0]) < 1e-3 and diff < 1e-2
    print(f"  chunked vs full: max|grad diff| {diff:.2e}  {'ok' if ok else 'FAIL'}")
    return [] if ok else ["chunked_loss"]


ISOLATION_BACKENDS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


def isolation_check(json_path: Path | None) -> list[str]:
    """The probe on every family; a combination that leaks or refuses its inputs is a failure, named."""
    import transformers

    from packtool.loader.probe import FAMILIES, format_probe, probe

    transformers.logging.set_verbosity_error()
    failures, reports = [], []
    for key in FAMILIES:
        flex = key == "llama" and torch.cuda.is_available()  # on CPU HF's flex path fails to compile
        backends = (*ISOLATION_BACKENDS, "flex_attention") if flex else ISOLATION_BACKENDS
        started = time.perf_counter()
        report = probe(key, backends=backends, feeds=("model_inputs", "one_document_per_row"))
        print(format_probe(report))
        print(f"  ({time.perf_counter() - started:.1f} s)")
        reports.append(report.as_dict())
        failures += [f"isolation:{key}:{row.backend}:{row.feed}" for row in report.rows if row.failed]
        if json_path is not None:  # written after every family: a run cut short keeps what it finished
            json_path.write_text(json.dumps(reports, indent=2) + "\n")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isolation-only", action="store_true", help="only the family x backend isolation probe")
    parser.add_argument("--time-limit", type=int, default=480, help="stop after this many seconds (default 480)")
    parser.add_argument("--json", type=Path, help="write the isolation reports here as JSON")
    args = parser.parse_args(argv)

    def out_of_time(signum, frame):
        raise TimeoutError(f"--time-limit {args.time_limit} s reached")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(args.time_limit)
    try:
        return run(args)
    except TimeoutError as err:
        print(f"STOPPED: {err}; the output above is what finished")
        return 2
    finally:
        signal.alarm(0)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    failures: list[str] = []
    if args.isolation_only:
        print("isolation probe (packtool.loader.probe), every family of docs/isolation.md:")
        failures = isolation_check(args.json)
        print(f"done in {time.perf_counter() - started:.1f} s; failures: {failures or 'none'}")
        return 1 if failures else 0
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print("CPU reference checks (float64 SDPA mask, float32 flex eager):")
    lengths = packed_lengths(512, seed=0)
    failures += compare(["sdpa"], lengths, 4, 32, torch.float64, "cpu", 1e-10)
    failures += compare(["flex"], lengths, 4, 32, torch.float32, "cpu", 1e-5)
    failures += compare_backward(["sdpa"], lengths, 4, 32, torch.float64, "cpu", 1e-10)
    print("chunked vs full loss (bf16, small, CPU):")
    failures += chunked_loss_check(vocab=4096, tokens=256, hidden=64, device="cpu")

    if not torch.cuda.is_available():
        print("SKIPPED (no CUDA): flash_attn, torch varlen_attn, bf16 flex, chunked loss at V=151,936, timing")
    else:
        print(f"CUDA: {torch.cuda.get_device_name()}")
        backends = ["sdpa", "flex"]
        if _torch_varlen() is not None:
            backends.insert(0, "torch_varlen")
        else:
            print("  torch varlen_attn: not in this torch, skipped")
        if _flash_attn_func() is not None:
            backends.insert(0, "flash_attn")
        else:
            print("  flash_attn: not importable, skipped")
        for capacity in (2048, 8192):
            lengths = packed_lengths(capacity, seed=capacity)
            print(f" packed row of {capacity} tokens, {len(lengths)} segments, bf16:")
            failures += compare(backends, lengths, 8, 64, torch.bfloat16, "cuda", 2e-2)
            failures += compare_backward(
                [b for b in backends if b != "flex"], lengths, 8, 64, torch.bfloat16, "cuda", 5e-2
            )
        print(" chunked loss vs full loss:")
        failures += chunked_loss_check()
        print(" timing (forward, bf16, 8 rows of 8192):")
        rows = [packed_lengths(8192, seed=s) for s in range(8)]
        for backend in backends:
            if backend in ("flex", "sdpa"):
                continue  # eager flex and the dense mask are references, not fast paths
            packed_vs_padded(backend, rows, 8, 64, torch.bfloat16, "cuda")

    print("isolation probe (packtool.loader.probe), every family of docs/isolation.md:")
    failures += isolation_check(args.json)
    print(f"done in {time.perf_counter() - started:.1f} s; failures: {sorted(set(failures)) or 'none'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
