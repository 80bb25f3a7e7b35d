"""A stand-in `ModelRunner.launch` for the async scheduling controls (CPU and CUDA): in a step
run ahead with rows whose ids are known on the host beside rows fed by the previous step's
samples, the fed rows' sources rotated among themselves, the known rows left alone."""

from __future__ import annotations


def rotating_fed_rows(launch, rotated: list[int]):
    """`launch` with the fed rows' sources rotated in every such step of two fed rows or more;
    rotated[0] counts those steps (the control must actually have run)."""

    def rotate(self, batch, reqs, ahead=None):
        if ahead is not None and -1 in ahead[0]:
            src = list(ahead[0])
            fed = [i for i, s in enumerate(src) if s >= 0]
            if len(fed) > 1:
                rotated[0] += 1
                for i, j in zip(fed, fed[1:] + fed[:1], strict=True):
                    src[i] = ahead[0][j]
            ahead = (src, ahead[1])
        return launch(self, batch, reqs, ahead)

    return rotate
