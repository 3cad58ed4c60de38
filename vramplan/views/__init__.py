"""Views of reports: terminal tables (rich); JSON is the report itself."""
