"""3-D positions (M-RoPE, Qwen2-VL) for a step's tokens, as transformers' get_rope_index gives them: text tokens
count on from the last position in all three axes; an image's placeholders take (temporal, height, width) positions
on its merged patch grid, offset by the position where it starts, and the text after it starts at that position plus
the grid's longer side; generated tokens continue from the prompt's largest position (`delta` past their index).
A row's prompt positions are computed once, from its images' grids, and kept on the worker's row."""
from __future__ import annotations

import torch

from batchjob.engine.worker.input_batch import CachedRow


def prompt_positions(row: CachedRow, merge: int) -> tuple[torch.Tensor, int]:
    """([3, num_prompt] positions of the row's prompt, the delta its generated tokens' positions take)."""
    parts, cur, prev = [], 0, 0
    for img in row.images:  # in prompt order
        parts.append(torch.arange(img.offset - prev).expand(3, -1) + cur)
        cur += img.offset - prev
        t, h, w = img.pixel_values.shape[0], img.pixel_values.shape[1] // merge, img.pixel_values.shape[2] // merge
        if t * h * w != img.length:
            raise ValueError(f"an image of {t} x {h} x {w} merged patches has {img.length} placeholders")
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")).reshape(3, -1)
        parts.append(grid + cur)
        cur += max(h, w)
        prev = img.offset + img.length
    parts.append(torch.arange(row.num_prompt - prev).expand(3, -1) + cur)
    table = torch.cat(parts, dim=1)
    return table, int(table.max()) + 1 - row.num_prompt


def step_positions(rows: list[CachedRow], last: list[int], positions: torch.Tensor, merge: int) -> torch.Tensor:
    """[3, T] for the step's flat 1-D `positions` (`last[i]`: the flat index of row i's last token)."""
    out = positions.expand(3, -1).clone()  # a row without images: its position in all three axes
    for i, row in enumerate(rows):
        if not row.images:
            continue
        if row.mrope is None:
            row.mrope = prompt_positions(row, merge)
        table, delta = row.mrope
        seg = slice(last[i] - row.num_new + 1, last[i] + 1)
        p = positions[seg]
        inside = p < row.num_prompt
        out[:, seg] = torch.where(inside, table.to(p.device)[:, p.clamp(max=row.num_prompt - 1)], p + delta)
    return out
