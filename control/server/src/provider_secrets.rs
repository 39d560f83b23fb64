//! The provider workflow's credentials: a provider pool names a control-plane secret (`site/<site>/secret/<name>`,
//! stored with `better-compute secrets put`), and the instances module resolves it through this implementation of
//! its [`ProviderSecrets`] trait at each operation — read from the store and opened with the secret box here, in
//! the control plane, never kept.

use bc_core::provider::SecretRef;
use bc_mod_instances::provider::{ProviderSecrets, SecretValue};
use bc_mod_sites::SecretBox;
use bc_store::Store;
use std::sync::Arc;
use zeroize::Zeroizing;

/// Secrets from the store, opened with this control plane's `secrets.key`.
pub struct StoreSecrets {
    pub store: Store,
    pub secrets: Arc<SecretBox>,
}

impl ProviderSecrets for StoreSecrets {
    fn resolve<'a>(&'a self, r: &'a SecretRef) -> SecretValue<'a> {
        Box::pin(async move {
            let sealed = self
                .store
                .secret(&r.site, &r.name)
                .await
                .map_err(|e| format!("reading it: {e}"))?
                .ok_or_else(|| {
                    format!(
                        "no such secret: store it with `better-compute secrets put --site {} {}`",
                        r.site, r.name
                    )
                })?;
            let plain = self
                .secrets
                .open(&r.site, &r.name, &sealed)
                .map_err(|e| e.to_string())?;
            Ok(Zeroizing::new(plain))
        })
    }
}

/// The kernel resource the instances module's provider workflow resolves credentials through.
pub fn resource(
    store: &Store,
    secrets: &Arc<SecretBox>,
) -> bc_mod_instances::provider::ProviderCredentials {
    bc_mod_instances::provider::ProviderCredentials(Arc::new(StoreSecrets {
        store: store.clone(),
        secrets: secrets.clone(),
    }))
}
