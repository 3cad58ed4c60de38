"""Callbacks that run vramplan.track inside training frameworks (imported on demand)."""
