"""Live migration: ``plan`` (numpy: which rows move where), ``transfer`` (Migrator, Migration:
stage, agree, commit, resend, abort), ``wire`` (transfer groups, point-to-point tag spaces, the
ranks-agree check)."""

from .plan import MigrationPlan, align_slots, plan_migration
from .transfer import Migration, MigrationError, Migrator

__all__ = ["MigrationPlan", "plan_migration", "align_slots", "Migrator", "Migration",
           "MigrationError"]
