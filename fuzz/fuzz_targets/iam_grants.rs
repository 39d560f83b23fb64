#![no_main]
//! The grant check a caller passes to hand out grants (`principals.create`: a caller never grants more than it
//! holds). Input: "<held pattern>\n<wanted pattern>\n<value>". Whenever `pattern_covers(held, wanted)` says the
//! held pattern covers the wanted one, every value the wanted pattern allows must be allowed by the held one, for
//! permissions (`:`) and scopes (`/`) alike; and `covers` on whole grants agrees with `allows` the same way.
use bc_core::iam::{Grant, allows, covers, pattern_covers};
use libfuzzer_sys::fuzz_target;

fn grant(permission: &str, scope: &str) -> Grant {
    Grant {
        permission: permission.into(),
        scope: scope.into(),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let mut parts = s.splitn(3, '\n');
    let (Some(held), Some(wanted), Some(value)) = (parts.next(), parts.next(), parts.next()) else {
        return;
    };
    // Permissions: `allows` on a scope that every side allows ("*").
    if pattern_covers(held, wanted, ':') && allows(&[grant(wanted, "*")], value, "pool/a") {
        assert!(
            allows(&[grant(held, "*")], value, "pool/a"),
            "{held:?} covers {wanted:?} but not its {value:?}"
        );
    }
    // Scopes, the same way.
    if pattern_covers(held, wanted, '/') && allows(&[grant("*", wanted)], "compute:x", value) {
        assert!(
            allows(&[grant("*", held)], "compute:x", value),
            "scope {held:?} covers {wanted:?} but not its {value:?}"
        );
    }
    // Whole grants: the held grant (held, held) covering the wanted (wanted, wanted).
    let h = [grant(held, held)];
    let w = grant(wanted, wanted);
    if covers(&h, &w) && allows(std::slice::from_ref(&w), value, value) {
        assert!(
            allows(&h, value, value),
            "{h:?} covers {w:?} but not {value:?}"
        );
    }
});
