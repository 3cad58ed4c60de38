"""Old name of vramplan.engines.memory_report, kept only for engines/formula.py while its split
into a package is under way on another branch; remove it once that import is renamed."""

from vramplan.engines.memory_report import (  # noqa: F401
    CATEGORIES,
    CATEGORY_HELP,
    SCHEMA_VERSION,
    TENSOR_CATEGORIES,
    GpuFit,
    MemoryReport,
    ModuleUsage,
)
