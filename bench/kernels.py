"""Kernels against torch eager (and liger-kernel where it applies), side by side, one table.

    python bench/kernels.py [--out FILE]

Each row times forward+backward (median of 5 after warm-up, CUDA synchronized) and measures the
peak memory allocated above the inputs. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import header, markdown_table, median_seconds
from thundersync import kernels

BF16 = torch.bfloat16
COLUMNS = [
    "kernel",
    "case",
    "ours",
    "ours ms",
    "baseline",
    "baseline ms",
    "speedup",
    "ours peak MiB",
    "baseline peak MiB",
    "memory ratio",
    "liger ms",
    "liger peak MiB",
]


def measure(fn: Callable[[], object]) -> tuple[float, float]:
    """(median milliseconds, peak MiB allocated above what was live before) of ``fn``."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return median_seconds(fn, warmup=1, repeat=5, cuda=True) * 1e3, peak


def row(
    kernel: str,
    case: str,
    ours: str,
    ours_fn: Callable[[], object],
    base: str,
    base_fn: Callable[[], object],
    liger_fn: Callable[[], object] | None = None,
) -> list[object]:
    t_o, m_o = measure(ours_fn)
    t_b, m_b = measure(base_fn)
    t_l, m_l = measure(liger_fn) if liger_fn is not None else ("-", "-")
    result = [
        kernel,
        case,
        ours,
        t_o,
        base,
        t_b,
        f"{t_b / t_o:.2f}x",
        m_o,
        m_b,
        f"{m_b / max(m_o, 1e-9):.1f}x",
        t_l,
        m_l,
    ]
    print(" | ".join(str(x) for x in result), flush=True)
    return result


def backward(fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor], *args: object) -> Callable[[], object]:
    def run() -> None:
        for leaf in leaves:
            leaf.grad = None
        fn(*leaves, *args).backward()

    return run


def logprob_rows(n: int = 16_384, width: int = 1024, vocab: int = 151_936) -> list[list[object]]:
    h = torch.randn(n, width, device="cuda", dtype=BF16)
    w = (torch.randn(vocab, width, device="cuda") * 0.05).to(BF16)
    y = torch.randint(0, vocab, (n,), device="cuda")

    def ours(hh: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        return -kernels.linear_logprobs(hh, ww, y).mean()

    def eager(hh: torch.Tensor, ww: torch.Tensor) -> torch.Tensor:
        return -torch.log_softmax((hh @ ww.t()).float(), -1).gather(1, y[:, None]).mean()

    liger = _liger_loss()
    rows = []
    for train_head in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_(train_head)
        leaves = [hh, ww] if train_head else [hh]
        bind = (lambda f: lambda a, b=ww: f(a, b)) if not train_head else (lambda f: f)  # noqa: B023
        case = f"T={n} H={width} V={vocab} bf16, grads: hidden" + (" + head" if train_head else "")
        liger_fn = backward(bind(lambda a, b: liger(b, a, y)), leaves) if liger is not None else None
        rows.append(
            row(
                "linear_logprobs",
                case,
                "fused",
                backward(bind(ours), leaves),
                "log_softmax+gather",
                backward(bind(eager), leaves),
                liger_fn,
            )
        )
    return rows


def _liger_loss() -> Callable[..., torch.Tensor] | None:
    if importlib.util.find_spec("liger_kernel") is None:
        print("liger-kernel is not installed: its column stays empty", flush=True)
        return None
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as error:  # an optional comparison column: say why it is empty and go on
        print(
            f"liger-kernel does not import here ({type(error).__name__}: {error}): its column stays empty", flush=True
        )
        return None
    loss: Callable[..., torch.Tensor] = LigerFusedLinearCrossEntropyLoss()  # mean CE = -mean log p(y)
    return loss


ATTENTION_CASES = [(0, 1024), (512, 64), (2048, 512), (4096, 1024), (8192, 2048), (8192, 128)]


def attention_rows(b: int = 2, hq: int = 16, hkv: int = 8, d: int = 128) -> list[list[object]]:
    paths: list[str | None] = [None, "varlen", "sdpa_split", "flex", "sdpa_masked"]  # None: the automatic choice
    if importlib.util.find_spec("flash_attn") is not None:
        paths.insert(0, "fa4")
    rows = []
    for p, t in ATTENTION_CASES:
        shapes = [(b, hq, t, d), (b, hkv, p, d), (b, hkv, p, d), (b, hkv, t, d), (b, hkv, t, d)]
        leaves = [torch.randn(*s, device="cuda", dtype=BF16, requires_grad=True) for s in shapes]
        mask = torch.ones(t, p + t, dtype=torch.bool, device="cuda").tril(p)

        def masked(
            q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
        ) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q,
                torch.cat([kp, kc], 2),
                torch.cat([vp, vc], 2),
                attn_mask=mask,  # noqa: B023 (called within the iteration)
                enable_gqa=True,
            )
            return out.float().square().mean()

        for path in paths:

            def ours(*x: torch.Tensor, path: str | None = path) -> torch.Tensor:
                return kernels.chunk_attention(*x, path=path).float().square().mean()

            case = f"B={b} Hq={hq} Hkv={hkv} D={d} P={p} T={t} bf16"
            rows.append(
                row(
                    "chunk_attention",
                    case,
                    path or "auto",
                    backward(ours, leaves),
                    "sdpa explicit mask",
                    backward(masked, leaves),
                )
            )
        print(f"P={p} T={t}: automatic choice so far {kernels.attention_path_counts()}", flush=True)
    return rows


def packed_rows(hq: int = 16, hkv: int = 8, d: int = 128) -> list[list[object]]:
    """A pack as the streaming engine forms it: 8 branches of 64-2048 tokens after a 512-token
    prompt, one ``varlen`` call (and one FA4 call, when installed) against a per-chunk loop of SDPA
    with an explicit mask."""
    q_lens, prefix = [64, 96, 150, 256, 384, 640, 1024, 2048], 512
    layout = kernels.PackedLayout(q_lens, [t + prefix for t in q_lens], torch.device("cuda"))
    n, m = layout.rows
    leaves = [
        torch.randn(*s, device="cuda", dtype=BF16, requires_grad=True) for s in ((n, hq, d), (m, hkv, d), (m, hkv, d))
    ]
    masks = [torch.ones(t, t + prefix, dtype=torch.bool, device="cuda").tril(prefix) for t in q_lens]

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, path: str) -> torch.Tensor:
        return kernels.packed_chunk_attention(q, k, v, layout, path=path).float().square().mean()

    def per_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        for q_c, k_c, v_c, mask in zip(q.split(q_lens), k.split(layout.k_lens), v.split(layout.k_lens), masks):
            heads = [x.transpose(0, 1)[None] for x in (q_c, k_c, v_c)]
            outs.append(F.scaled_dot_product_attention(*heads, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs).float().square().mean()

    case = f"8 chunks T=64..2048 (N={n}) after P={prefix}, Hq={hq} Hkv={hkv} D={d} bf16"
    paths = ["varlen"] + (["fa4"] if importlib.util.find_spec("flash_attn") is not None else [])
    return [
        row(
            "packed_chunk_attention",
            case,
            f"{path} (1 call)",
            backward(ours, leaves, path),
            "sdpa explicit mask per chunk",
            backward(per_chunk, leaves),
        )
        for path in paths
    ]


SECTIONS: dict[str, Callable[[], list[list[object]]]] = {
    "logprobs": logprob_rows,
    "packed": packed_rows,
    "attention": attention_rows,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="also write the header and table to this file")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=list(SECTIONS),
        default=list(SECTIONS),
        help="which parts of the table to measure (default: all)",
    )
    args = parser.parse_args()
    rows = [r for name in args.sections for r in SECTIONS[name]()]
    sections = "" if args.sections == list(SECTIONS) else " --sections " + " ".join(args.sections)
    text = header("python bench/kernels.py" + sections) + "\n" + markdown_table(COLUMNS, rows) + "\n\nprobes:\n"
    text += "\n".join(
        f"- {c.kernel} {c.device} {c.dtype} {c.shape_class}: {'ok' if c.ok else c.why}"
        for c in kernels.kernel_capabilities()
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
