"""`pytest --part K/N` (tests/conftest.py): a long run (pytest -m gpu) split into N parts that
together select every test once."""

from __future__ import annotations

import pytest
from conftest import pytest_collection_modifyitems


class _Config:
    def __init__(self, part):
        self.part = part
        self.deselected = []
        self.hook = self

    def getoption(self, name):
        assert name == "--part"
        return self.part

    def pytest_deselected(self, items):
        self.deselected += items


class _Item:
    def __init__(self, i, marked=True, keywords=("gpu",)):
        self.i, self.marked, self.added = i, marked, []
        self.keywords = dict.fromkeys(keywords, True)

    def get_closest_marker(self, name):
        return pytest.mark.gpu.mark if name == "gpu" and self.marked else None

    def add_marker(self, marker):
        self.added.append(marker)


@pytest.mark.parametrize("n_items, n", [(126, 3), (10, 4), (3, 5), (1, 1)])
def test_the_parts_select_every_test_once(n_items, n):
    items = [_Item(i) for i in range(n_items)]
    seen = []
    for k in range(1, n + 1):
        part, config = list(items), _Config(f"{k}/{n}")
        pytest_collection_modifyitems(config, part)
        seen += [it.i for it in part]
        assert sorted(it.i for it in part + config.deselected) == list(range(n_items))
        assert len(part) in (n_items // n, -(-n_items // n))  # about as long as each other
    assert sorted(seen) == list(range(n_items))


@pytest.mark.parametrize("spec", ["3", "0/2", "3/2", "a/b"])
def test_a_malformed_part_says_what_it_wants(spec):
    with pytest.raises(pytest.UsageError, match="K/N"):
        pytest_collection_modifyitems(_Config(spec), [_Item(0)])


def test_without_cuda_only_tests_marked_gpu_are_skipped(monkeypatch):
    # a test in tests/gpu has "gpu" among its keywords (the folder) without the marker: it runs
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    marked, in_the_folder, plain = _Item(0), _Item(1, marked=False), _Item(2, marked=False, keywords=())
    pytest_collection_modifyitems(_Config(None), [marked, in_the_folder, plain])
    assert [m.name for m in marked.added] == ["skip"]
    assert in_the_folder.added == [] and plain.added == []
