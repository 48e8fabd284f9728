"""The loss-curve PNG: written whole or not at all."""

import pytest

from phalanx.observe.plot import plot_loss_curve


def test_a_plot_cut_short_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """A run killed (or out of disk) while loss_curve.png is written: the file under that name is the earlier plot,
    never the first bytes of the new one (it was written in place)."""
    from matplotlib.figure import Figure

    history = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    path = tmp_path / "loss_curve.png"
    plot_loss_curve(history, path)
    earlier = path.read_bytes()
    assert earlier.startswith(b"\x89PNG")
    real_savefig = Figure.savefig

    def cut_short(self, target, **kwargs):
        real_savefig(self, target, **kwargs)
        with open(target, "r+b") as f:
            f.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", cut_short)
    with pytest.raises(OSError):
        plot_loss_curve(history + [{"kind": "eval", "step": 3, "loss": 0.5}], path)
    assert path.read_bytes() == earlier
