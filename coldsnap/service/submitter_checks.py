"""The service's side of its policy (coldsnap.formats.service_policy): who the submitter is in
this node's user database, and what a submission names. Both run at submission, before the
operation's `prepare`: a refused submission touches nothing."""

from __future__ import annotations

import grp
import os
import pwd

from coldsnap.formats.service_policy import (
    ServicePolicy,
    request_refusals,
    reserved_workload_refusal,
)
from coldsnap.service.submission import CLIENT_FILES, Submission


def group_names(uid: int, gid: int | None) -> set[str]:
    """The names of the groups `uid` is in: the peer's gid (SO_PEERCRED), the passwd entry's
    primary group and its supplementary groups. A uid without a passwd entry has only its
    peer gid."""
    gids = {gid} if gid is not None else set()
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        entry = None
    if entry is not None:
        gids.update(os.getgrouplist(entry.pw_name, entry.pw_gid))
    names = set()
    for g in gids:
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            continue
    return names


def submitter_refusal(policy: ServicePolicy, uid: int, gid: int) -> str | None:
    """Why `uid` may not submit, or None. Root always may (held to the rules unless the
    policy says `unrestricted: true`)."""
    if uid == 0:
        return None
    allowed = policy.submitters.groups
    if set(allowed) & group_names(uid, gid):
        return None
    groups = ", ".join(allowed) or "none: only root may submit"
    return (f"uid {uid} is in none of submitters.groups ({groups}); the service's policy "
            "refuses its submissions")


def submission_refusals(policy: ServicePolicy, sub: Submission, uid: int) -> list[str]:
    """Every rule of the policy that the submission breaks, one line each naming its field."""
    # Named as the user gave them: the command's flags.
    paths = [("--" + name.replace("_", "-"), str(sub.options[name])) for name in CLIENT_FILES
             if sub.options.get(name) is not None]
    lines = request_refusals(policy, uid, sub.request, client_paths=paths)
    # Workload ids are global: a reserved prefix is its groups' to start (and root's).
    if policy.workloads.reserved and uid != 0:
        reserved = reserved_workload_refusal(policy, uid, sub.request, group_names(uid, None))
        if reserved is not None:
            lines.append(reserved)
    return lines


def shares_artifacts(policy: ServicePolicy, uid: int) -> bool:
    """Whether `uid` may restore, publish or delete another uid's artifacts: root, or a
    member of one of the policy's artifacts.shared_with groups."""
    return uid == 0 or bool(set(policy.artifacts.shared_with) & group_names(uid, None))
