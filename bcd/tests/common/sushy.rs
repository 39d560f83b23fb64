//! sushy-tools' Redfish emulator (`sushy-emulator --fake`) on loopback with HTTP Basic auth for [`USER`] and
//! [`PASSWORD`], for the tests that drive a BMC: bc_testkit::sushy finds it (`BC_SUSHY_EMULATOR`, the checkout's
//! .venv-sushy, the PATH) and starts it in a directory of its own. Without it a test skips with the reason.

use bc_testkit::sushy::{FakeBmc, FakeOptions, fake_emulator};

pub const USER: &str = "bmc-admin";
pub const PASSWORD: &str = "Sushy-pw-7f3a9c1e";

/// Starts the emulator with Basic auth for USER/PASSWORD (it serves its service root and refuses its systems
/// without credentials), or says why it cannot run here (then the test skips).
pub fn start_emulator() -> anyhow::Result<Result<FakeBmc, String>> {
    let bin = match fake_emulator() {
        Ok(bin) => bin,
        Err(why) => return Ok(Err(why)),
    };
    if !bin.with_file_name("python3").is_file() {
        return Ok(Err(format!(
            "no python3 beside {} to hash the htpasswd file with bcrypt",
            bin.display()
        )));
    }
    let opts = FakeOptions {
        basic_auth: Some((USER.into(), PASSWORD.into())),
        ..FakeOptions::default()
    };
    FakeBmc::start(&bin, &opts)
        .map(Ok)
        .map_err(anyhow::Error::msg)
}
