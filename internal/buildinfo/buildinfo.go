// Package buildinfo says which build of the companion programs is running,
// for their --version flag. It is not a place for anything else about the
// build.
package buildinfo

import "runtime/debug"

// Version returns stamped when the build set it (make dist links
// -X main.version=$(git describe --always --dirty)); otherwise the VCS
// revision Go recorded in the binary (with "-dirty" when the tree had
// changes), or "devel" when there is none, as with -buildvcs=false or a
// build outside a repository.
func Version(stamped string) string {
	if stamped != "" {
		return stamped
	}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	return fromSettings(info.Settings)
}

func fromSettings(settings []debug.BuildSetting) string {
	var rev string
	var dirty bool
	for _, s := range settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev == "" {
		return "devel"
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if dirty {
		rev += "-dirty"
	}
	return rev
}
