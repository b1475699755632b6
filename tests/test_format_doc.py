"""docs/format.md is the contract: its pack_hash recipe must recompute the hashes the build stores."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
from support import REPO


def test_the_documented_pack_hash_recipe_recomputes_the_stored_hashes(quickstart_build):
    text = (REPO / "docs" / "format.md").read_text(encoding="utf-8")
    section = text[text.index("### Recomputing `pack_hash`") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(code, namespace)  # the reader's copy of the recipe, exactly as documented
    table = pq.read_table(next(iter(sorted(quickstart_build.glob("shard-*.parquet")))))
    rows = table.to_pylist()
    assert rows
    for row in rows:
        assert namespace["pack_hash"](row["input_ids"], row["labels"], row["cu_seqlens"]) == row["pack_hash"]
