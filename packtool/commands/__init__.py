"""The read side's commands: what looks at an output (or, for `audit`, at a config before a build) and
prints it. They read the build's contract (packtool.format, packtool.shards) and the numbers in
packtool.summaries; the builder imports none of them (tests/test_imports.py).

    stats      an output's numbers, printed          verify    every promise of an output, re-derived
    show       one pack token by token (inspect)     find      a sample to its packs and back to its line
    report     one offline HTML page                 lineage   what a training step saw (trace)
    audit      the template and tokenizer, before a long build
"""
