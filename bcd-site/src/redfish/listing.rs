//! Reading a collection page by page, sans-I/O: [`Listing`] takes each decoded page and says which page to fetch
//! next (`Members@odata.nextLink`), until there is none. It never stops silently: a loop of next links, the page
//! cap, a `Members@odata.count` that disagrees with what was listed and links given twice all become warnings, and
//! [`Listed::complete`] says whether the list can be trusted to hold every member (an action that picks "the only
//! system" must not act on an incomplete list).

#![deny(clippy::disallowed_methods)]

use std::collections::HashSet;

use super::decode::FieldWarning;
use super::models::{Collection, Member};

/// Pages followed at most.
pub const MAX_PAGES: usize = 64;

/// `/redfish/v1/Systems/1/` and `/redfish/v1/Systems/1` are one resource: trailing slashes go, and so does a
/// `scheme://host` prefix pointing at the same service (some BMCs write absolute links). Query strings stay.
pub fn normalize(path: &str) -> String {
    let mut p = path.trim();
    if let Some(rest) = p
        .strip_prefix("https://")
        .or_else(|| p.strip_prefix("http://"))
    {
        p = rest.find('/').map_or("/", |i| &rest[i..]);
    }
    let (path_part, query) = p.split_once('?').map_or((p, None), |(a, b)| (a, Some(b)));
    let trimmed = path_part.trim_end_matches('/');
    let mut out = if trimmed.is_empty() {
        "/".to_owned()
    } else {
        trimmed.to_owned()
    };
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// The members of one collection, as they were listed.
#[derive(Debug, Clone, Default)]
pub struct Listed {
    /// The collection's path.
    pub collection: String,
    /// Members in the order listed, each once.
    pub members: Vec<Member>,
    /// `Members@odata.count` of the first page.
    pub count: Option<u64>,
    /// Pages read.
    pub pages: usize,
    /// False when a next link was not followed (a loop, the cap) or a page could not be read.
    pub complete: bool,
    pub warnings: Vec<String>,
}

/// The paging state of one collection.
#[derive(Debug)]
pub struct Listing {
    listed: Listed,
    seen_pages: HashSet<String>,
    seen_members: HashSet<String>,
    done: bool,
}

impl Listing {
    pub fn new(collection: &str) -> Listing {
        Listing {
            listed: Listed {
                collection: collection.to_owned(),
                complete: true,
                ..Listed::default()
            },
            seen_pages: HashSet::from([normalize(collection)]),
            seen_members: HashSet::new(),
            done: false,
        }
    }

    /// Adds one decoded page (with the warnings its decode produced); returns the page to fetch next.
    pub fn page(
        &mut self,
        page: &str,
        collection: Collection,
        warnings: &[FieldWarning],
    ) -> Option<String> {
        if self.done {
            return None;
        }
        self.listed.pages += 1;
        for w in warnings {
            self.listed.warnings.push(format!("{page}: {w}"));
        }
        if self.listed.pages == 1 {
            self.listed.count = collection.count;
        }
        for m in collection.members {
            if m.odata_id.trim().is_empty() {
                self.listed
                    .warnings
                    .push(format!("{page}: a member without @odata.id was skipped"));
                continue;
            }
            let key = normalize(&m.odata_id);
            if !self.seen_members.insert(key) {
                self.listed.warnings.push(format!(
                    "{page}: member {} is listed more than once; counted once",
                    m.odata_id
                ));
                continue;
            }
            self.listed.members.push(m);
        }
        let next = collection.next_link.filter(|n| !n.trim().is_empty());
        let Some(next) = next else {
            self.finish_count();
            self.done = true;
            return None;
        };
        if self.listed.pages >= MAX_PAGES {
            self.stop(format!(
                "{}: stopped after {MAX_PAGES} pages (next link {next}): the list is incomplete",
                self.listed.collection
            ));
            return None;
        }
        if !self.seen_pages.insert(normalize(&next)) {
            self.stop(format!(
                "{}: next link {next} points back to a page already read: the list may be incomplete",
                self.listed.collection
            ));
            return None;
        }
        Some(next)
    }

    /// A page that could not be read: the list is incomplete.
    pub fn failed(&mut self, page: &str, why: &str) {
        self.stop(format!(
            "{}: page {page} could not be read ({why}): the list is incomplete",
            self.listed.collection
        ));
    }

    fn stop(&mut self, warning: String) {
        self.listed.warnings.push(warning);
        self.listed.complete = false;
        self.done = true;
    }

    fn finish_count(&mut self) {
        if let Some(count) = self.listed.count
            && count != self.listed.members.len() as u64
        {
            self.listed.warnings.push(format!(
                "{}: Members@odata.count says {count} but {} member(s) were listed",
                self.listed.collection,
                self.listed.members.len()
            ));
        }
    }

    pub fn into_listed(self) -> Listed {
        self.listed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(members: &[&str], count: Option<u64>, next: Option<&str>) -> Collection {
        Collection {
            members: members
                .iter()
                .map(|m| Member {
                    odata_id: (*m).to_owned(),
                    body: Default::default(),
                })
                .collect(),
            count,
            next_link: next.map(str::to_owned),
        }
    }

    #[test]
    fn follows_pages_dedups_and_checks_the_count() {
        let mut l = Listing::new("/redfish/v1/Systems");
        let next = l.page(
            "/redfish/v1/Systems",
            page(
                &["/s/1", "/s/2/"],
                Some(4),
                Some("/redfish/v1/Systems?$skip=2"),
            ),
            &[],
        );
        assert_eq!(next.as_deref(), Some("/redfish/v1/Systems?$skip=2"));
        let next = l.page("p2", page(&["/s/2", "/s/3"], None, None), &[]);
        assert_eq!(next, None);
        let listed = l.into_listed();
        let ids: Vec<&str> = listed.members.iter().map(|m| m.odata_id.as_str()).collect();
        assert_eq!(ids, ["/s/1", "/s/2/", "/s/3"]);
        assert!(listed.complete);
        assert_eq!(listed.warnings.len(), 2, "{:?}", listed.warnings);
        assert!(listed.warnings[0].contains("listed more than once"));
        assert!(listed.warnings[1].contains("count says 4 but 3"));
    }

    #[test]
    fn a_loop_or_a_failed_page_makes_the_list_incomplete() {
        let mut l = Listing::new("/c");
        assert_eq!(l.page("/c", page(&["/a"], None, Some("/c/")), &[]), None);
        let listed = l.into_listed();
        assert!(!listed.complete);
        assert!(
            listed.warnings[0].contains("points back"),
            "{:?}",
            listed.warnings
        );

        let mut l = Listing::new("/c");
        let next = l.page("/c", page(&["/a"], Some(2), Some("/c?page=2")), &[]);
        l.failed(next.as_deref().unwrap_or_default(), "HTTP 500");
        let listed = l.into_listed();
        assert!(!listed.complete);
        assert!(listed.warnings[0].contains("could not be read (HTTP 500)"));
    }

    #[test]
    fn normalizes_paths() {
        assert_eq!(normalize("/redfish/v1/Systems/1/"), "/redfish/v1/Systems/1");
        assert_eq!(normalize("https://10.0.0.1/redfish/v1/"), "/redfish/v1");
        assert_eq!(normalize("/c/?$skip=2"), "/c?$skip=2");
        assert_eq!(normalize("/"), "/");
    }
}
