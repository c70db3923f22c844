"""Speculative decoding: drafters propose the next tokens of a request, the engine verifies them in one forward
(engine/loop/speculate.py). One module per concept: the Drafter interface and its spec parser (drafter.py), the spec -> drafter (spec.py), the
radix-lookahead / n-gram drafter (ngram.py), the fixed-acceptance test drafter (fixed_rate.py), the verification
of one position (rejection.py), the adaptive draft length (draft_length.py)."""
