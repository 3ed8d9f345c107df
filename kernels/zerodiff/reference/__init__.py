"""Pure-torch references (float64 / exact integer logic) that define each op's contract."""
