//! Fuzz what reservations decode from outside: the API's request body (parse, validate, hash, place on a small
//! fleet) and, on the node, the desired state's bookings rendered into a CDI spec. Nothing may panic.
#![no_main]

use bc_core::placer::{Capacity, FreeGpu};
use bc_core::reservation::ReservationRequest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = serde_json::from_slice::<ReservationRequest>(data) {
        let _ = req.body_hash();
        if req.validate().is_ok() {
            let mut c = Capacity::default();
            for n in 0..3 {
                let gpus = (0..8)
                    .map(|i| FreeGpu {
                        device_id: format!("n{n}/gpu/{i}"),
                        uuid: format!("GPU-{n}-{i}"),
                        idx: i,
                        clique: (i % 2 == 0).then(|| format!("c{n}")),
                    })
                    .collect();
                c.set_node(&format!("n{n}"), "H100", gpus);
            }
            if let Ok(p) = c.place(&req) {
                assert_eq!(p.gpu_count(), req.gpus as usize);
                c.take(&p);
            }
        }
    }
    if let Ok(spec) = serde_json::from_slice::<serde_json::Value>(data)
        && let Ok(bookings) = bcd::cdi::bookings(&spec)
    {
        let local: Vec<bcd::cdi::LocalGpu> = (0..4)
            .map(|i| bcd::cdi::LocalGpu {
                uuid: format!("GPU-{i}"),
                minor: Some(i),
            })
            .collect();
        let _ = bcd::cdi::render(&bookings, &local);
    }
});
