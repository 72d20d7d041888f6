"""Independent NumPy oracles for the tests: float64 products slot by slot, and a loop-based metadata twin."""

from __future__ import annotations

import numpy as np


def shrink_np(x, a, token_slot, ranks, scalings, num_slices):
    """[T, S·R] float64: scaling[s] · x[t] @ A[s, i*R + j]ᵀ for j < rank[s], else 0; slot -1 rows 0."""
    x, a, token_slot = np.asarray(x, np.float64), np.asarray(a, np.float64), np.asarray(token_slot)
    rank = a.shape[1] // num_slices
    out = np.zeros((x.shape[0], a.shape[1]))
    for s in np.unique(token_slot[token_slot >= 0]):
        t, r = token_slot == s, int(ranks[s])
        for i in range(num_slices):
            out[t, i * rank : i * rank + r] = scalings[s] * (x[t] @ a[s, i * rank : i * rank + r].T)
    return out


def expand_np(y, b, token_slot, ranks, base, slice_sizes):
    """[T, N] float64: base[t] + y[t, slice i, :rank] @ B[s, slice_i, :rank]ᵀ per slice; slot -1 rows = base."""
    y, b, token_slot = np.asarray(y, np.float64), np.asarray(b, np.float64), np.asarray(token_slot)
    out = np.array(base, np.float64)
    rank = b.shape[2]
    for s in np.unique(token_slot[token_slot >= 0]):
        t, r, col = token_slot == s, int(ranks[s]), 0
        for i, n in enumerate(slice_sizes):
            out[t, col : col + n] += y[t, i * rank : i * rank + r] @ b[s, col : col + n, :r].T
            col += n
    return out


def build_np(token_slot, num_slots, block_m):
    """Loop twin of `LoRABatchInfo.build`: (sorted_idx, counts, [(start, len, slot)] of used segments)."""
    token_slot = np.asarray(token_slot)
    sorted_idx = [t for s in range(num_slots) for t in range(len(token_slot)) if token_slot[t] == s]
    sorted_idx += [t for t in range(len(token_slot)) if token_slot[t] < 0]
    counts = [int((token_slot == s).sum()) for s in range(num_slots)]
    segments, pos = [], 0
    for s in range(num_slots):
        for off in range(0, counts[s], block_m):
            segments.append((pos + off, min(block_m, counts[s] - off), s))
        pos += counts[s]
    return np.array(sorted_idx), np.array(counts), segments


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def worst_row_err(out, ref) -> float:
    """The largest per-row ‖out[t] − ref[t]‖ / ‖ref[t]‖ of [T, N] arrays: a single wrong or unwritten row fails a
    bound that the global `rel_err` of a large T would let through (one row in 8192 moves it by about 1 %)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float((np.linalg.norm(out - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)).max())


def paged_attention_np(q, k_pages, v_pages, positions, tables, window=None):
    """[B, KV, G, D] float64: each request's query against its positions 0..position (those in the window),
    gathered one by one from the blocks its table names (position p: block tables[b, p // S], offset p % S)."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    size = k_pages.shape[2]
    out = np.zeros(q.shape)
    for b, pos in enumerate(np.asarray(positions)):
        seen = [p for p in range(int(pos) + 1) if window is None or p > pos - window]
        keys = np.stack([k_pages[tables[b][p // size], :, p % size] for p in seen], axis=1)  # [KV, T, D]
        values = np.stack([v_pages[tables[b][p // size], :, p % size] for p in seen], axis=1)
        scores = np.einsum("kgd,ktd->kgt", q[b], keys) / np.sqrt(q.shape[-1])
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[b] = np.einsum("kgt,ktd->kgd", weights / weights.sum(axis=-1, keepdims=True), values)
    return out
