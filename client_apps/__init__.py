"""The ClientApp and the per-method client logic it dispatches to."""
