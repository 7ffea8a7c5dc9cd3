"""The grid of W4A16 products on which the dispatch table's choices are pinned (``test_dispatch.py``), and the
choices written in one line per device and layer: ``choice_lines`` renders them, ``dispatch_choices.txt`` holds
those the dispatch made before it became a table (``w4a16_linear``'s chain of plan functions), so any change of
choice shows as a diff of lines."""

from __future__ import annotations

# (capability, SMs, Triton version): Hopper with the Triton the Gluon kernels are written for, at 132 and 114 SMs;
# Ampere and Blackwell capabilities (the sm_90-only paths decline, the mma.sync gemv runs from sm_90 on)
DEVICES = (((9, 0), 132, "3.6.0"), ((9, 0), 114, "3.6.0"), ((8, 0), 108, "3.6.0"), ((10, 0), 148, "3.6.0"))
# decoder layers of Llama-2/3 (7-8B and 70B, fused qkv and gate/up included), Qwen2.5 (0.5B, 7B, 72B) and odd sizes
LAYERS = ((4096, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (28672, 8192),
          (8192, 28672), (4096, 11008), (8192, 29568), (3584, 3584), (9728, 896), (4098, 4096), (256, 512))  # fmt: skip
GROUPS = (32, 64, 128, 256, 0)  # the kernel layout's contiguous group length; 0: one group per column
BITS_GROUPS = (*((4, g) for g in GROUPS), (8, 128), (8, 0))
MS = (1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 24, 32, 33, 40, 48, 64, 65, 96, 128, 129, 200, 256, 257, 384, 512, 513, 1024,
      4096)  # fmt: skip


def render(path: str, name: str, split: int) -> str:
    return f"{path}:{name}" + (f"/{split}" if split > 1 else "")


def choice_lines(choose) -> list[str]:
    """One line per (device, bits, group, layer): the choices over MS, consecutive equal ones merged as
    ``m_first-m_last=path:config/split``. ``choose(cap, sms, triton, bits, group, m, n, k)`` -> (path, name, split)."""
    lines = []
    for cap, sms, version in DEVICES:
        for bits, group in BITS_GROUPS:
            for n, k in LAYERS:
                if group and k % group:
                    continue
                runs: list[list] = []
                for m in MS:
                    c = render(*choose(cap, sms, version, bits, group, m, n, k))
                    if runs and runs[-1][2] == c:
                        runs[-1][1] = m
                    else:
                        runs.append([m, m, c])
                cells = " ".join(f"{a}-{b}={c}" for a, b, c in runs)
                lines.append(f"sm{cap[0]}{cap[1]} {sms} t{version[:3]} w{bits} g{group} {n}x{k}: {cells}")
    return lines
