"""What training frameworks do by default, each setting with its source (profiles.toml)."""

from vramplan.frameworks.profiles import (
                                          Allowed,
                                          Profile,
                                          Setting,
                                          apply_profile,
                                          framework_names,
                                          get_profile,
                                          load_profiles,
                                          profile_problems,
)

__all__ = ["Allowed", "Profile", "Setting", "apply_profile", "framework_names", "get_profile",
           "load_profiles", "profile_problems"]
