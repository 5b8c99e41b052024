"""rosetta diff: where two implementations part, and the porting mistake that explains it."""
