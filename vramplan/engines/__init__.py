"""Engines take a Job and return a MemoryReport. Only `formula` is imported eagerly:
trace and measure import torch, so they load on first use."""
