"""Speed measurements: ratios against a peer measured in the same run, never unit tests."""
